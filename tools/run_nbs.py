"""Run the notebooks as `nbdev_test` does, without nbdev: for a stack nbdev 2 cannot be installed on (fastcore 2).
As nbdev_test: cells whose leading `#|` directives name one of settings.ini's `tst_flags` (`notest cuda slow`), `#| eval:
false` cells, `nbdev_export(` cells and `skip_exec` notebooks are skipped; each notebook runs in `nbs/` with the repository
on `sys.path`, in execnb's `CaptureShell` (execnb 0.1 or 0.3), in a process of its own; a failing cell stops it.
`python tools/run_nbs.py [--n-workers 2] [NOTEBOOK ...]` (default: every notebook in `nbs/`); exit 1 if any failed.
`FASTAI_FP16_DEFAULT_DEVICE=meta` / `FASTAI_FP16_ASSUME_CPU=avx2|...` run them as on another machine (tools/pretend.py)."""
import argparse, configparser, os, re, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

root = Path(__file__).resolve().parent.parent
_direc = re.compile(r'\s*#\s*\|\s*(.*)')

def directives(src:str)->dict:
    "The leading `#|` lines of a cell as {name: args}: `#| eval: false` -> {'eval': ['false']}"
    res = {}
    for l in src.splitlines():
        if not l.strip() or l.lstrip().startswith('%%'): continue  # nbdev looks past blank lines and cell magics
        m = _direc.match(l)
        if not m: break  # directives are the cell's first lines, as in nbdev
        name, *args = m[1].replace(':', ' ').split() or ['']
        res[name] = args
    return res

def skipped(cell, flags:set)->bool:
    "Whether `nbdev_test` leaves `cell` out"
    if cell.cell_type != 'code': return True
    if 'nbdev_export' + '(' in cell.source: return True
    d = directives(cell.source)
    return d.get('eval', [''])[0].lower() == 'false' or bool(flags & d.keys())

def run_one(fn:Path)->int:
    "Run notebook `fn` here; print the failing cell's traceback and return 1 if one fails"
    try: from execnb.nbio import read_nb
    except ImportError: from fastcore.nbio import read_nb  # execnb 0.3 moved it to fastcore
    from execnb.shell import CaptureShell
    cfg = configparser.ConfigParser(); cfg.read(root/'settings.ini')
    flags = set(cfg['DEFAULT']['tst_flags'].split())
    nb = read_nb(fn)
    if any(re.search(r'^\s*-?\s*skip_exec:\s*true', c.source, re.M) for c in nb.cells[:2] if c.cell_type != 'code'): return 0
    os.environ['IN_TEST'] = '1'
    sys.path.insert(0, str(root))
    from pretend import pretend_from_env  # FASTAI_FP16_ASSUME_CPU, FASTAI_FP16_DEFAULT_DEVICE: tools/pretend.py
    pretend_from_env()
    os.chdir(fn.parent)
    k = CaptureShell(fn)
    try: k.run_all(nb, exc_stop=True, preproc=lambda c: skipped(c, flags))
    except BaseException:
        sys.stderr.write(k.prettytb(fname=fn) + '\n'); return 1
    return 0

def notebooks(paths:list)->list:
    "The notebooks named, or every one under `nbs/` (not `_*` or `.*` files and folders, as nbdev's `nbglob`)"
    if paths: return [Path(p).resolve() for p in paths]
    return sorted(p for p in (root/'nbs').rglob('*.ipynb') if not any(s.startswith(('_', '.')) for s in p.relative_to(root/'nbs').parts))

def _run(fn:Path):
    t = time.time()
    r = subprocess.run([sys.executable, __file__, '--one', str(fn)], capture_output=True, text=True)
    return fn, r.returncode, time.time() - t, r.stdout + r.stderr

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('notebooks', nargs='*', help='notebooks to run (default: all of nbs/)')
    p.add_argument('--n-workers', type=int, default=2, help='notebooks run at once (default: 2)')
    p.add_argument('--one', help=argparse.SUPPRESS)  # the worker: one notebook, in this process
    a = p.parse_args()
    if a.one: sys.exit(run_one(Path(a.one)))
    fns = notebooks(a.notebooks)
    if not fns: sys.exit("No notebooks found: nothing was tested, which is a failure.")
    failed = []
    with ThreadPoolExecutor(max(1, a.n_workers)) as ex:
        for fn, rc, t, out in ex.map(_run, fns):
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {fn.name} ({t:.0f} s)", flush=True)
            if rc: failed.append(fn.name); print(out[-6000:], flush=True)
    if failed: sys.exit(f"{len(failed)} of {len(fns)} notebooks failed: {', '.join(failed)}")
    print(f"All {len(fns)} notebooks passed.")
