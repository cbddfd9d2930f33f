"""The package's three layers: the library (`fastai_fp16/`, what `learn.to_half()` runs) imports nothing from the study
(`fastai_fp16/study/`) or the tools (`fastai_fp16/tools/`), the study nothing from the tools; no module imports another in
a cycle (imports inside functions count); the modules that moved still import by their old names; and
`from fastai_fp16.all import *` gives the names it gave before they moved."""
import ast, importlib, os, subprocess, sys
from pathlib import Path
import pytest
import fastai_fp16

PKG = Path(fastai_fp16.__file__).parent
ROOT = PKG.parent

def modules(pkg:Path=PKG)->dict:
    "Every module of the package as {dotted name under the package: path}: 'core', 'study.claims', 'study' (its `__init__`), '' (the package's)"
    res = {}
    for p in sorted(pkg.rglob('*.py')):
        parts = p.relative_to(pkg).with_suffix('').parts
        if parts[-1] == '_modidx' or '__pycache__' in parts: continue
        res['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = p
    return res

def _imported(path:Path, name:str, mods:dict)->set:
    "The modules of `mods` that module `name` (at `path`) imports, anywhere in it: `from .x import`, `from ..x import`, `from fastai_fp16.x import`, `import fastai_fp16.x`"
    pkg = name if path.name == '__init__.py' else name.rpartition('.')[0]  # what `from .x` is relative to
    res = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split('.') if pkg else []
                parts = parts[:len(parts) - (node.level - 1)]
                base = '.'.join(parts + ([node.module] if node.module else []))
            elif node.module == 'fastai_fp16' or (node.module or '').startswith('fastai_fp16.'): base = node.module[len('fastai_fp16.'):]
            else: continue
            for a in node.names:  # `from . import bench`: the module `bench`; `from .core import x`: `core`
                sub = f'{base}.{a.name}' if base else a.name
                res.add(sub if sub in mods else base)
        elif isinstance(node, ast.Import):
            res |= {a.name[len('fastai_fp16.'):] for a in node.names if a.name.startswith('fastai_fp16.')}
    return {m for m in res if m in mods} - {name}

def import_graph(pkg:Path=PKG)->dict:
    mods = modules(pkg)
    return {n: _imported(p, n, mods) for n,p in mods.items()}

def layer(name:str)->str:
    "'study', 'tools', or 'library' (the package's own folder); `all` hands on the three layers' names and is none of them"
    top = name.split('.')[0]
    return top if top in ('study', 'tools') else 'face' if name in ('', 'all') else 'library'

def find_cycle(graph:dict)->list|None:
    "A cycle of `graph` (module -> modules it imports) as a list of modules, or None"
    state, stack = {}, []
    def visit(m):
        state[m] = 'open'; stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 'open': return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)): return c
        state[m] = 'done'; stack.pop()
    for m in graph:
        if m not in state and (c := visit(m)): return c

def test_find_cycle_finds_one():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b', 'c'}, 'b': {'c'}, 'c': set()}) is None

def test_parser_reads_every_form(tmp_path):
    (tmp_path/'sub').mkdir()
    for f in ('__init__', 'core', 'scaler', 'monitor', 'bench', 'sub/__init__', 'sub/cli', 'sub/x'): (tmp_path/f'{f}.py').write_text('')
    (tmp_path/'mod.py').write_text("from .core import x\nimport fastai_fp16.scaler\nfrom fastai_fp16.monitor import y\n"
                                   "def f():\n    from fastai_fp16.sub.cli import z\nfrom . import bench\nimport os\n")
    (tmp_path/'sub'/'x.py').write_text("from ..core import a\nfrom .cli import b\nfrom .. import __version__\nfrom . import cli\n")
    mods = modules(tmp_path)
    assert {'', 'core', 'sub', 'sub.cli', 'sub.x', 'mod'} <= set(mods)
    assert _imported(tmp_path/'mod.py', 'mod', mods) == {'core', 'scaler', 'monitor', 'sub.cli', 'bench'}
    assert _imported(tmp_path/'sub'/'x.py', 'sub.x', mods) == {'core', 'sub.cli', ''}

def test_no_import_cycle():
    g = import_graph()
    assert {'tools.cli', 'tools.bench', 'mixed_precision', 'core', 'study.claims'} <= set(g) and 'core' in g['mixed_precision']  # read
    assert find_cycle(g) is None, f"import cycle: {' -> '.join(find_cycle(g))}"

def test_layers():
    "The library imports nothing from the study or the tools, the study nothing from the tools (by what the code says)"
    g = import_graph()
    assert {layer(m) for m in g} == {'library', 'study', 'tools', 'face'} and 'study.memory' in g['tools.bench']  # read
    bad = {(m, n) for m, ns in g.items() for n in ns
           if (layer(m), layer(n)) in {('library', 'study'), ('library', 'tools'), ('study', 'tools'), ('library', 'face')}}
    assert not bad, f"imports across the layers, upward: {sorted(bad)}"

def test_library_loads_nothing_of_study_or_tools():
    "In a fresh interpreter, importing every library module loads no module of `fastai_fp16.study` or `fastai_fp16.tools`"
    lib = sorted(m for m in modules() if layer(m) == 'library')
    code = ("import sys, importlib\n" + ''.join(f"importlib.import_module('fastai_fp16.{m}')\n" for m in lib) +
            "print(sorted(m for m in sys.modules if m.startswith(('fastai_fp16.study', 'fastai_fp16.tools'))))")
    r = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])})
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'learner' in lib and r.stdout.strip().splitlines()[-1] == '[]', r.stdout

def test_importing_registers_nothing_in_fastais_defaults():
    "Issue 56.4: after `from fastai.basics import *`, importing fastai_fp16 (and `.all`) leaves `defaults.callbacks` as it was, and a half fit runs there"
    code = ("import sys\nfrom fastai.basics import *\nfrom fastai.learner import defaults\nnames = lambda: [c.__name__ for c in defaults.callbacks]\n"
            "before = names()\nimport fastai_fp16\nafter = names()\nimport fastai_fp16.all\nfrom fastai_fp16.all import *\nafter_all = names()\n"
            "import torch.nn as nn\nlearn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16')\n"
            "learn.fit(1, 1e-2); learn.validate()\n"
            "print(before == after == after_all == names(), 'ProgressCallback' in after_all, 'fastai.callback.progress' in sys.modules)")
    r = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == 'True False False', r.stdout  # no progress table added to the user's Learners

def test_the_package_shows_its_layers():
    "`ls fastai_fp16`: the library's modules, `study/` and `tools/`; the old names are no files"
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != '__pycache__'} == {'study', 'tools'}
    assert not [old for old in fastai_fp16._moved if (PKG/f'{old}.py').exists()]
    assert max(len(p.read_text().splitlines()) for n,p in modules().items() if n != 'all') <= 310  # no module over ~300 lines

def test_old_names_import_the_moved_modules():
    for old, new in fastai_fp16._moved.items():
        assert importlib.import_module(f'fastai_fp16.{old}') is importlib.import_module(f'fastai_fp16.{new}'), old
        assert getattr(fastai_fp16, old) is sys.modules[f'fastai_fp16.{new}']
    from fastai_fp16.callbacks import MixedPrecision
    from fastai_fp16.mixed_precision import MixedPrecision as MP
    from fastai_fp16.study import train, __all__ as names  # the module `study` is the study's folder: it gives the claims' names
    import fastai_fp16.study.claims as claims
    assert MixedPrecision is MP and train is claims.train and names == claims.__all__
    with pytest.raises(ImportError): importlib.import_module('fastai_fp16.no_such_module')
    with pytest.raises(AttributeError): fastai_fp16.no_such_name

def test_old_names_in_a_fresh_interpreter():
    "An old name imported first, as a user's script would (and the console script an older install wrote: `fastai_fp16.cli:main`)"
    code = ("from fastai_fp16.experiments import RECIPES\nfrom fastai_fp16.guard import BufferGuard\n"
            "import fastai_fp16.study_run, fastai_fp16.cli as c, fastai_fp16.tools.cli as t\nassert c is t\n"
            "from fastai_fp16.study import digits_data\nprint(RECIPES.__class__.__name__, BufferGuard.__module__, fastai_fp16.study_run.__name__)")
    r = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ['fastai_fp16.buffer_guard', 'fastai_fp16.study.run'], r.stdout

# `from fastai_fp16.all import *` before the modules moved (issue 35): the same names after (and issue 54's new ones); issue
# 53 took out the window's hooks (`run_fp32`, `Fp32Hooks`, `land_buffers`: nothing is put on the model any more) and added fp32
# math's functional forms; issue 56's `to_float` makes bf16 optimizer states fp32 with `fp32_states`; issue 62's doctor
# advises from `measure_auto` (`advice`)
ALL_NAMES = ['AutoChannelsLast', 'Autocast', 'BatchNormToFloat', 'BufferGuard', 'CallTimer', 'Capabilities', 'ConvFp32', 'DeviceSteps', 'EMA',
    'LinearFp32', 'LossScaleError', 'LossScaler', 'MixedPrecision', 'ModelToHalf', 'PeakMemory', 'PrecisionMonitor',
    'PrecisionPlan', 'PrecisionReport', 'RECIPES', 'SkipValid', 'StepTimer', 'SynthDL', 'adam_variants', 'advice', 'archs',
    'assume_capabilities', 'batch_overhead', 'bench', 'bench_main', 'bench_shape', 'bf16_kahan', 'bf16_master', 'bf16_nomaster',
    'bf16_split', 'bf16_stochastic', 'capped_loss',
    'cast_floats', 'check_device', 'check_fastai_precision', 'compare', 'conv_fp32', 'conv_kind', 'convert_network', 'cpu_caps', 'cpu_classes',
    'cpu_features', 'cpu_variants', 'cuda_caps', 'cuda_variants', 'cudnn_state', 'detect', 'digits_dls', 'digits_folder',
    'doctor', 'e2e_bench', 'fake_imagenette', 'fastai_adam_kind', 'fastai_device', 'fastai_native', 'fastai_precision', 'fastai_step_fn', 'fit_cbs',
    'flat_like', 'float_tensors', 'folder_dls', 'fp16_bn32', 'fp16_loss32', 'fp16_master', 'fp16_pure',
    'fp16_static_nomaster', 'fp32', 'fp32_plan_overhead', 'fp32_states', 'fused_adam_step', 'fused_adam_supported', 'fused_adam_target', 'half_dtype',
    'half_params', 'half_support', 'imagenette_dls', 'imagenette_url', 'kept_fp32', 'layer_bench', 'layer_variants',
    'layout_asked', 'linear_fp32', 'machine_info', 'make_flat_master', 'markdown_table', 'master_params_to_model_params', 'measure_auto', 'median_ms',
    'model_grads_to_master_grads', 'module_tensors', 'mps_caps', 'named_ours', 'nonfinite_', 'norm_classes', 'norm_types', 'nvidia_static128', 'nvidia_tf_cnn',
    'older_names', 'opt_step_times', 'ours_step_fn', 'overhead_bench', 'param_shapes', 'patch_fp32_math', 'plan_fit', 'plan_kind',
    'plan_precision', 'plot_loss_scale', 'plot_losses', 'precision_report', 'prefers_channels_last', 'prep_param_lists',
    'recipe', 'recipe_style', 'remove_fastai_precision', 'run_recipe', 'run_variant', 'shaped_like', 'small_cnn', 'soft_cap',
    'stand_in_model', 'synth_dls', 'tf_cnn', 'tiny_model', 'unpatch_fp32_math', 'unscale_grads_', 'unuse_fused_adam',
    'use_fused_adam', 'variant_label', 'xpu_caps']

def test_all_gives_the_same_names():
    import fastai_fp16.all as a
    assert sorted(n for n in dir(a) if not n.startswith('_')) == ALL_NAMES
