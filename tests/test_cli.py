"The `fastai-fp16` console script from a shell: its command list, and its default output folders left out of git"
import inspect, shutil, subprocess, sys, pytest
from pathlib import Path
from fastai_fp16.tools.cli import _cmds

ROOT = Path(__file__).resolve().parents[1]

def _outs()->dict:
    "Each command's default output folder: {command: folder}"
    ps = {n: inspect.signature(c.__wrapped__).parameters for n,c in _cmds.items()}
    return {n: p['out'].default for n,p in ps.items() if 'out' in p and p['out'].default}

def test_default_outputs_ignored():
    outs = _outs()
    assert set(outs) >= {'compare', 'train', 'study'}, outs
    if not (ROOT/'.git').exists() or shutil.which('git') is None: pytest.skip('not a git checkout')
    for n,d in outs.items():  # what a user's clone would show in `git status` after running the command there
        r = subprocess.run(['git', 'check-ignore', '-q', f'{d}/results.csv'], cwd=ROOT)
        assert r.returncode == 0, f"{n}'s default output folder {d}/ is not in .gitignore"

def test_help_from_a_shell():
    r = subprocess.run([sys.executable, '-c', 'import sys; from fastai_fp16.tools.cli import main; sys.exit(main())', '--help'],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for n in [*_cmds, 'help', '--version']: assert any(l.startswith(f'  {n} ') for l in lines), r.stdout

def test_console_script_entry_point():
    "settings.ini's `console_scripts` (what `pip install` writes as `fastai-fp16`) names the CLI's `main`, where it lives now"
    import configparser, importlib
    from fastai_fp16.tools.cli import main
    cfg = configparser.ConfigParser(); cfg.read(ROOT/'settings.ini')
    name, _, target = cfg.get('DEFAULT', 'console_scripts', raw=True).partition('=')
    mod, _, fn = target.strip().partition(':')
    assert name.strip() == 'fastai-fp16' and getattr(importlib.import_module(mod), fn) is main
    assert importlib.import_module('fastai_fp16.cli').main is main  # what an install made before the move names
