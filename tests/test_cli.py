"The `fastai-fp16` console script from a shell: its command list and help (before torch loads), its default output folders left out of git, nothing written in the home folder"
import contextlib, inspect, io, json, os, shutil, subprocess, sys, pytest
from pathlib import Path
from fastai_fp16.tools.cli import _cmds, _func, _parser, main

ROOT = Path(__file__).resolve().parents[1]

def _outs()->dict:
    "Each command's default output folder: {command: folder}"
    return {n: d for n in _cmds if (d := _parser(n).get_default('out'))}

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

# what a user asks before running anything: the list, `help` itself, each command's options
HELPS = [['--help'], ['help'], ['help', '--help'], ['help', '-h'], *[[c, '--help'] for c in _cmds], *[['help', c] for c in _cmds]]

def _main(argv:list)->tuple:
    "(exit status, stdout) of `fastai-fp16 *argv`, in this process"
    o = io.StringIO()
    with contextlib.redirect_stdout(o): rc = main(argv)
    return rc, o.getvalue()

def test_help_imports_no_torch(monkeypatch):
    "Every help answers before torch or fastai is imported (issue 46: it took 5 s), with the text the commands' own functions give"
    code = ("import sys, json, io, contextlib\nfrom fastai_fp16.tools.cli import main\nres = []\n"
            "for a in json.loads(sys.argv[1]):\n    o = io.StringIO()\n"
            "    with contextlib.redirect_stdout(o): res.append((main(a), o.getvalue()))\n"
            "print(json.dumps(dict(res=res, imported=[m for m in ('torch','fastai','numpy','pandas','matplotlib') if m in sys.modules])))")
    env = {**os.environ, 'COLUMNS': '100'}  # argparse wraps to the terminal's width
    r = subprocess.run([sys.executable, '-c', code, json.dumps(HELPS)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got['imported'] == [], got['imported']
    monkeypatch.setenv('COLUMNS', '100')
    import fastai_fp16.study.run, fastai_fp16.tools.bench  # here `study` and `bench` are their modules' functions, not read from source
    for a,(rc,out) in zip(HELPS, got['res']): assert (rc, out) == _main(a), a

def test_help_of_help_and_of_each_command():
    "`help --help` is the list; `help CMD` is `CMD --help`: its description and every option, spelled with dashes"
    rc, usage = _main(['--help'])
    assert rc == 0 and _main(['help', '--help']) == (0, usage) and _main(['help']) == (0, usage)
    for c in _cmds:
        rc, out = _main([c, '--help'])
        assert rc == 0 and out.startswith(f'usage: fastai-fp16 {c} ') and _main(['help', c]) == (0, out), c
        f = _func(c)
        assert ' '.join(f.__doc__.split())[:40] in ' '.join(out.split()), out
        for k in inspect.signature(f).parameters: assert f"--{k.replace('_', '-')}" in out, (c, k)

def test_commands_write_nothing_in_home(tmp_path):
    "`compare` and `train` on the embedded digits, HOME an empty folder: they write under --out only (issue 46: ~/.fastai)"
    home, tmp, out = tmp_path/'home', tmp_path/'tmp', tmp_path/'out'
    home.mkdir(); tmp.mkdir()
    tiny = ['--epochs', '1', '--size', '8', '--bs', '256', '--device', 'cpu']
    code = ("import sys, json\nfrom fastai_fp16.tools.cli import main\n"
            "for a in json.loads(sys.argv[1]): assert main(a) == 0, a")
    runs = [['compare', '--recipes', 'fp32,bf16_master', '--out', str(out/'compare'), *tiny], ['train', '--out', str(out/'train'), *tiny]]
    # fastai's folder would be HOME's (no FASTAI_HOME); matplotlib's font cache, its own, goes elsewhere
    env = {k:v for k,v in os.environ.items() if k != 'FASTAI_HOME'} | dict(HOME=str(home), TMPDIR=str(tmp), MPLCONFIGDIR=str(tmp_path/'mpl'))
    r = subprocess.run([sys.executable, '-W', 'ignore', '-c', code, json.dumps(runs)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(home.rglob('*')) == []
    assert not list(tmp.glob('fastai_fp16_*'))  # the digits' temporary folder is gone
    assert sorted(p.name for p in (out/'compare').iterdir()) == ['loss_scale.png', 'losses.png', 'results.csv', 'results.md']
    assert [p.name for p in (out/'train').iterdir()] == ['model.pkl']

def test_help_says_how_long_compare_takes():
    "Issue 56.14: `--help` and `compare --help` give the main command's duration on a 2-core CPU"
    import re
    for argv in (['--help'], ['compare', '--help']):
        rc, out = _main(argv)
        assert rc == 0 and re.search(r'about \d+ minutes on a 2-core CPU', ' '.join(out.split())), out

def test_live_bytes_leaves_kinetos_log_out():
    "Issue 56.14: torch's profiler (`LiveBytes`) on a machine without a GPU prints no `gpuGetDeviceCount failed` ERROR line (nor its USDT lines)"
    code = ("import torch.nn as nn\nfrom fastai.learner import Learner\nfrom fastai_fp16.core import synth_dls, tiny_model\n"
            "from fastai_fp16.tools.bench_live import LiveBytes\n"
            "learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=LiveBytes(at=1))\n"
            "learn.fit(1, 1e-2)\nprint(learn.live_bytes.peak is not None)")
    env = {k: v for k, v in os.environ.items() if k != 'KINETO_LOG_LEVEL'}
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
    r = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == 'True', r.stderr[-2000:]
    assert 'gpuGetDeviceCount' not in r.stderr and 'USDT' not in r.stderr, r.stderr[-2000:]
