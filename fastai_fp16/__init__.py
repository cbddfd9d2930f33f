"""Mixed-precision training for fastai: `learn.to_half()`.

Three layers: this folder is the library (what `learn.to_half()` runs), `study/` the seed study (its data, the precision
ladder, its claims checked), `tools/` the `fastai-fp16` command (`compare`, `study`, `bench`, `doctor`). The library imports
nothing from the other two (tests/test_imports.py); `fastai_fp16.all` hands on every public name of all three."""
__version__ = "0.1.0"
import importlib, importlib.abc, importlib.util, sys

_moved = {  # modules moved or renamed (issue 35): old name -> where the module is now; the old name imports that very module
    'callbacks': 'mixed_precision', 'guard': 'buffer_guard',
    'data': 'study.data', 'experiments': 'study.ladder', 'memory': 'study.memory', 'study_practice': 'study.practice',
    'study_run': 'study.run',  # and `fastai_fp16.study` is the study's folder now, which hands on `study.claims`' names
    'bench': 'tools.bench', 'bench_overhead': 'tools.bench_overhead', 'cli': 'tools.cli', 'cli_parser': 'tools.cli_parser',
    'doctor': 'tools.doctor', 'torch_optim': 'tools.torch_optim'}

class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    "`import fastai_fp16.<old>` (and `from fastai_fp16.<old> import ...`) gets the module at `fastai_fp16.<new>` (`_moved`)"
    def find_spec(self, fullname, path=None, target=None):
        pkg, _, old = fullname.partition('.')
        if pkg == __name__ and old in _moved: return importlib.util.spec_from_loader(fullname, self)
    def create_module(self, spec): return importlib.import_module(f'{__name__}.{_moved[spec.name.partition(".")[2]]}')
    def exec_module(self, module): pass  # the module was run where it lives

# first: an old name is always the moved module, never a file of that name some other finder has (an older install's)
if not any(type(f).__name__ == '_MovedFinder' for f in sys.meta_path): sys.meta_path.insert(0, _MovedFinder())

def __getattr__(name):  # `fastai_fp16.cli` as an attribute, as after `import fastai_fp16.cli`
    if name in _moved: return importlib.import_module(f'{__name__}.{name}')
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
