"""The native runtime every room may use and that uses no other room: the C++ op builder
(`build`), CPU feature detection (`cpu`), huge pages, host lists, host memory facts
(`memory`: what the process may still allocate), and the C++ headers shared by several
rooms' kernels (`csrc/`: the thread team, vector helpers, the window ring)."""
