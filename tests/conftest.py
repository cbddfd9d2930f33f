"""Shared fixtures. `FASTAI_FP16_ASSUME_CPU=avx2|avx512|avx512_bf16|amx|arm_bf16` runs every test as on that CPU class,
`FASTAI_FP16_DEFAULT_DEVICE=meta` with fastai's `default_device()` saying 'meta' as it says CUDA on a GPU box
(tools/pretend.py): tools to find tests that depend on the CPU class, or that do not pin their device."""
import importlib.util, warnings, pytest, torch
# the tests run with fastai's bars, `no_bar`, `lr_find`, `fit_one_cycle`, as after a fastai user's star import; fastai_fp16
# imports neither itself (test_imports: importing it leaves fastai's defaults as they were)
import fastai.callback.progress, fastai.callback.schedule
from pathlib import Path
warnings.filterwarnings('ignore', category=FutureWarning)  # torch.jit deprecation noise from fastai's imports

_spec = importlib.util.spec_from_file_location('pretend', Path(__file__).resolve().parents[1]/'tools'/'pretend.py')
_spec.loader.exec_module(_pretend := importlib.util.module_from_spec(_spec))
_pretend.pretend_from_env()

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
