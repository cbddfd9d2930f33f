"""The `fastai-fp16` command (`cli`, its options `cli_parser`), what it measures (`bench`, `bench_overhead`, `torch_optim`)
and `doctor` (what is fast on the hardware at hand)."""
