"""The KV storage and the kernels that attend over it: the pool's tensors and their dtypes
and quantized formats (`storage`, `quant`, `swap`'s host copies), and paged attention in
torch (the reference), C++ on CPU and Triton on CUDA. The model runner owns the storage;
kvpool/ holds the metadata (block ids, tables) that says which slots a request reads."""
