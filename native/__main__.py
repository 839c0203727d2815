"""`python -m native --build [NAME ...]`: build kvserve's C++ ops ahead of use."""

from native.build import main

raise SystemExit(main())
