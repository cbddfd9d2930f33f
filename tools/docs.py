"""Build the documentation site in `_docs/` from `nbs/*.ipynb`, offline: `python tools/docs.py` (after `pip install -e ".[docs]"`).
The notebooks of `nbs/study/` and `nbs/tools/` are pages of those folders, a group each in the navigation (`groups`).

Quarto (what `nbdev_docs` renders with) cannot be installed here, so each notebook goes through nbdev's own
processing, run from Python (tools/docs_nb.py: every cell executed, outputs cached), is written to `_proc/` in
MyST's syntax (tools/docs_myst.py), and Sphinx renders `_proc/` with MyST-NB and the Furo theme (tools/sphinx/).
Both steps are incremental: a notebook whose code did not change is not run again, and Sphinx rewrites only the
pages whose notebook changed. `--force` rebuilds everything."""
import argparse, hashlib, json, shutil, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from nbdev.config import get_config
from nbdev.doclinks import nbglob, _nbpath2html

tools = Path(__file__).resolve().parent

def plan()->dict:
    "Each notebook -> (its page in `_proc/`, its outputs cache, the page's name in the site)"
    cfg = get_config()
    proc = cfg.config_path/'_proc'
    res = {}
    for p in sorted(nbglob(cfg.nbs_path, as_path=True)):
        h = _nbpath2html(p.relative_to(cfg.nbs_path))  # what nbdev names each page: 00_core.ipynb -> core.html
        res[p] = (proc/h.with_suffix('.ipynb'), proc/'.cache'/h.with_suffix('.json'), h.as_posix())
    return res

_groups = {'': 'The library', 'study': 'The study', 'tools': 'The tools'}  # nbs/ and its folders, as the package's

def groups(htmls:list)->list:
    "The site's navigation: (caption, pages) for the library (`nbs/`), the study (`nbs/study/`) and the tools (`nbs/tools/`)"
    res = {c: [] for c in _groups.values()}
    for h in htmls:
        if h == 'index.html': continue
        d = h.rpartition('/')[0]
        res.setdefault(_groups.get(d, d), []).append(h[:-len('.html')])
    return [(c, docs) for c, docs in res.items() if docs]

def write_page(nb_path:Path):
    "Process one notebook and write its page to `_proc/` (run as its own process: notebooks share no state)"
    sys.path.insert(0, str(tools))
    from docs_nb import process_nb
    from docs_myst import Links, to_myst
    cfg, pages = get_config(), plan()
    out, cache, html = pages[nb_path]
    site = cfg.doc_host.rstrip('/') + '/' + cfg.doc_baseurl.strip('/')
    links = Links(site, {p.name: h for p,(_,_,h) in pages.items()}, html)
    toctree = groups([h for _,_,h in pages.values()]) if html == 'index.html' else None
    txt = json.dumps(to_myst(process_nb(nb_path, cache), links, toctree), indent=1, ensure_ascii=False) + '\n'
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_text() != txt: out.write_text(txt)  # an unchanged page keeps its mtime: Sphinx skips it
    cache.with_suffix('.done').touch()  # see `_fresh`

_inputs = ('docs.py', 'docs_nb.py', 'docs_myst.py', 'term.py')  # the code that writes a page

def _fresh(p:Path, cache:Path, index:bool)->bool:
    "Whether `p`'s page was written after everything it comes from changed: then it need not be processed at all"
    stamp, cfg = cache.with_suffix('.done'), get_config()
    if not (stamp.exists() and cache.exists()): return False
    srcs = [p, cfg.config_file, cfg.lib_path/'_modidx.py'] + [tools/f for f in _inputs] + ([p.parent, *(d for d in p.parent.iterdir() if d.is_dir())] if index else [])  # the index lists every page
    if stamp.stat().st_mtime < max(f.stat().st_mtime for f in srcs if f.exists()): return False
    try: deps = json.loads(cache.read_text())['deps']  # the package modules its outputs came from
    except (OSError, ValueError, KeyError): return False
    root = cfg.config_path
    return all((root/f).is_file() and hashlib.sha256((root/f).read_bytes()).hexdigest() == h for f,h in deps.items())

def _run_one(p:Path):
    t = time.time()
    r = subprocess.run([sys.executable, __file__, '--page', str(p)], capture_output=True, text=True)
    return p, time.time() - t, r

def build(force:bool=False, workers:int=2, strict:bool=False)->int:
    "Write every notebook's page to `_proc/`, then run Sphinx into `_docs/`; returns an exit code"
    cfg = get_config()
    proc, docs = cfg.config_path/'_proc', cfg.config_path/cfg.doc_path
    if force: shutil.rmtree(proc, ignore_errors=True); shutil.rmtree(docs, ignore_errors=True)
    pages = plan()
    for f in proc.rglob('*.ipynb'):  # pages whose notebook is gone
        if f not in {o for o,_,_ in pages.values()}: f.unlink()
    def cost(p):  # longest first (as last timed), so that the last job to start is a short one
        try: return -json.loads(pages[p][1].read_text())['seconds']
        except (OSError, ValueError, KeyError): return -p.stat().st_size
    todo = [p for p,(_,c,h) in pages.items() if not _fresh(p, c, h == 'index.html')]
    print(f'{len(pages)-len(todo)} of {len(pages)} pages up to date')
    t0, failed = time.time(), []
    with ThreadPoolExecutor(workers) as ex:
        for p, secs, r in ex.map(_run_one, sorted(todo, key=cost)):
            if r.returncode: failed.append(p.name); print(f'FAILED {p.name}:\n{r.stderr[-6000:]}', file=sys.stderr)
            else: print(f'{p.name}: {secs:.1f} s')
    if failed: print(f'docs: notebooks failed: {", ".join(failed)}', file=sys.stderr); return 1
    print(f'notebooks: {time.time()-t0:.1f} s')
    t1 = time.time()
    cmd = [sys.executable, '-m', 'sphinx', '-b', 'html', '-q', '-c', str(tools/'sphinx'), '-d', str(proc/'.doctrees'),
           str(proc), str(docs)] + (['-W', '--keep-going'] if strict else [])
    rc = subprocess.run(cmd).returncode
    print(f'sphinx: {time.time()-t1:.1f} s; site: {docs/"index.html"}')
    return rc

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--force', action='store_true', help='ignore the caches: run every notebook, rewrite every page')
    ap.add_argument('--workers', type=int, default=2, help='notebooks processed at once (default 2)')
    ap.add_argument('--strict', action='store_true', help='Sphinx warnings are errors')
    ap.add_argument('--page', help=argparse.SUPPRESS)  # internal: process this one notebook (see `write_page`)
    a = ap.parse_args()
    if a.page: write_page(Path(a.page)); sys.exit(0)
    t = time.time()
    rc = build(a.force, a.workers, a.strict)
    print(f'docs: {"built" if rc == 0 else "FAILED"} in {time.time()-t:.1f} s')
    sys.exit(rc)
