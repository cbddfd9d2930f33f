"""Run the tests or the notebooks as on another machine, to find those whose result depends on it. Opt-in, by env var:

- `FASTAI_FP16_ASSUME_CPU=avx2|avx512|avx512_bf16|amx|arm_bf16`: `detect('cpu')` says that CPU class
  (`assume_capabilities(cpu_caps(...))`; a test's or a cell's own `assume_capabilities` wins inside it). Run the suite
  under each class: a test or cell whose result changes should inject the capabilities it assumes itself.
- `FASTAI_FP16_DEFAULT_DEVICE=meta`: fastai's `default_device()` says 'meta', as it says CUDA on a GPU box. No data
  lives on 'meta', so a test or cell that relies on the default device instead of pinning one fails at once, on a CPU.

tests/conftest.py applies them to `pytest -q tests`, tools/run_nbs.py to each notebook; `nbdev_test` has no hook for them."""
import os, sys
from contextlib import ExitStack

_held = ExitStack()  # the modes' contexts, held for the life of the process (a context left unreferenced would close)

def set_default_device(device:str):
    "Make fastai's `default_device()` return `device`, in `fastai.torch_core` and in every module that imported the name"
    import torch, fastai.torch_core as tc, fastai.learner  # fastai.learner imports fastai.data.core, fastai.callback.core
    orig, dev = tc.default_device, torch.device(device)
    def default_device(use=-1):
        "fastai's `default_device`, but the device it would pick by itself is `dev` (tools/pretend.py)"
        return dev if use == -1 and tc.defaults.use_cuda is None else orig(use)
    # fastai.data.core, fastai.learner, fastai.callback.core... bind the name when imported: modules imported later
    # take it from torch_core (`from ..torch_core import *`), those already imported are patched here
    for m in [tc] + [m for m in list(sys.modules.values()) if getattr(m, 'default_device', None) is orig]:
        m.default_device = default_device
    # where fastai picks a device for data, models and `load_learner`; if it moves, this mode would silently test nothing
    import fastai.data.core, fastai.callback.core
    if any(m.default_device() != dev for m in (fastai.data.core, fastai.callback.core, fastai.learner)):
        raise RuntimeError("fastai no longer reads its default device where tools/pretend.py sets it: update it.")

def pretend_from_env():
    "Apply the modes the environment asks for (for this whole process)"
    dev, cls = os.environ.get('FASTAI_FP16_DEFAULT_DEVICE'), os.environ.get('FASTAI_FP16_ASSUME_CPU')
    if dev: set_default_device(dev)
    if cls:
        from fastai_fp16.hardware import assume_capabilities, cpu_caps
        _held.enter_context(assume_capabilities(cpu_caps(cls)))
    if dev or cls: print(f"tools/pretend.py: default_device() {dev or 'as is'}, CPU class {cls or 'as detected'}", file=sys.stderr)
