"""One notebook for the docs site: nbdev's own processing (a `show_doc` after every exported symbol, hidden and export
cells dropped, the title made front matter), with every cell executed so that each page shows its results.

nbdev itself runs only the cells its `show_doc`s need (and runs a test cell whole when it mixes imports with other
code). We run all cells in order in one shell, as `nbdev_test` does and with its skips (`tst_flags` such as
`slow`/`cuda`, `eval: false`), so a page shows what the tests saw and a flagged cell never runs.
Outputs are cached per notebook, keyed on its code cells and on the package modules it imported: editing prose, or
a module it does not use, re-executes nothing."""
import ast, hashlib, json, os, re, sys, time
from importlib.metadata import version
from pathlib import Path
try: from execnb.nbio import read_nb, mk_cell, _dict2obj
except ImportError: from fastcore.nbio import read_nb, mk_cell, _dict2obj  # execnb 0.3 moved them to fastcore
from execnb.shell import CaptureShell
from nbdev.config import get_config
from nbdev.process import Processor
from nbdev.processors import FilterDefaults, exec_show_docs, add_show_docs, _do_eval, _re_ansi_escape as _ansi
from term import terminal_text

_tools = Path(__file__).parent
_env = ' '.join(f'{p}={version(p)}' for p in ('torch', 'fastai', 'fastcore', 'nbdev', 'execnb'))

def _sha(b:bytes)->str: return hashlib.sha256(b).hexdigest()

def whole_description(nb):
    "Join the title cell's `>` description lines into one: nbdev's front matter keeps only the first"
    c = next((c for c in nb.cells if c.cell_type == 'markdown'), None)
    if c is None or not re.match(r'#\s', c.source): return
    while (s := re.sub(r'^(>[ \t].*)\n>[ \t]*(?=\S)', r'\1 ', c.source, count=1, flags=re.M)) != c.source: c.source = s

_event = re.compile(r'^(before|after)_')  # fastai callback events: what a fit calls, not what a user calls

class add_method_docs(Processor):
    "A `show_doc` after a class's for each of its public documented methods (nbdev documents the class alone)"
    def begin(self):
        cells = self.nb.cells
        shown = set(re.findall(r'^show_doc\(([\w.]+)\)', '\n'.join(c.source for c in cells if c.cell_type == 'code'), re.M))
        classes = {o.name: o for c in cells if c.cell_type == 'code' and c.directives_.keys() & {'export', 'exports'}
                   for o in (c.parsed_() or []) if isinstance(o, ast.ClassDef)}
        for cell in [c for c in cells if getattr(c, 'has_sd', False)]:
            cls = classes.get(cell.source[len('show_doc('):-1])
            if cls is None: continue
            names = [f'{cls.name}.{o.name}' for o in cls.body if isinstance(o, ast.FunctionDef) and o.name[0] != '_'
                     and not _event.match(o.name) and ast.get_docstring(o)
                     and not any(getattr(d, 'id', '') == 'property' for d in o.decorator_list)]
            i = cells.index(cell)
            for nm in reversed([n for n in names if n not in shown]):
                new = mk_cell(f'show_doc({nm}, title_level=4)')  # under its class in the page's contents
                new.has_sd = True
                cells.insert(i+1, new)

class exec_all(Processor):
    "Run every code cell `nbdev_test` runs, or take the outputs from the cache when nothing they depend on changed"
    nb_path = cache_path = None  # set by `process_nb`
    def begin(self):
        self.skip = set(get_config().get('tst_flags', '').split())
        fm = getattr(self.nb, 'frontmatter_', {})
        self.docs_only = str(fm.get('skip_exec', '')).lower() == 'true'  # nbdev_test skips it: run only what show_doc needs
        self.code = {id(c): i for i,c in enumerate(c for c in self.nb.cells if c.cell_type == 'code' and c.source)}
        src = json.dumps([[c.source, sorted(c.directives_.items())] for c in self.nb.cells if id(c) in self.code])
        tools = ''.join((_tools/f).read_text() for f in ('docs_nb.py', 'term.py'))
        self.key = _sha((src + _env + tools).encode())
        self.cached = self._load()
        if self.cached is None:
            self.k, self.t0, self.outs = CaptureShell(self.nb_path), time.time(), {}
            self.k.run_cell('from nbdev.showdoc import show_doc')

    def _load(self):
        try: c = json.loads(self.cache_path.read_text())
        except (OSError, ValueError): return None
        root = get_config().config_path
        fresh = all((root/p).is_file() and _sha((root/p).read_bytes()) == h for p,h in c['deps'].items())
        return c if c['key'] == self.key and fresh else None

    def _runs(self, cell)->bool:
        if self.docs_only: return bool(_do_eval(cell))
        d = cell.directives_
        return ('nbdev_export(' not in cell.source and d.get('eval:', [''])[0].lower() != 'false'
                and not (self.skip & d.keys()))

    def __call__(self, cell):
        i = self.code.get(id(cell))
        if i is None: return
        if self.cached is not None: cell.outputs = _dict2obj(self.cached['outputs'][i]); return
        if not self._runs(cell): return
        self.k.cell(cell)
        if self.k.exc: raise RuntimeError(f"a cell raised while building the docs:\n{self.k.prettytb(self.nb_path)}")
        for o in cell.get('outputs', []):
            if o.get('output_type') == 'stream':  # nbdev's `strip_ansi` ran before: outputs were not there yet
                o['text'] = terminal_text(_ansi.sub('', ''.join(o['text']))).splitlines(True)
        # a stream that held only progress bars is empty now: no empty box on the page
        cell.outputs = [o for o in cell.get('outputs', []) if o.get('output_type') != 'stream' or ''.join(o['text']).strip()]
        self.outs[i] = cell.outputs

    def end(self):
        if self.cached is not None: return
        cfg = get_config()
        root, lib, deps = cfg.config_path.resolve(), cfg.lib_name, {}
        for n,m in list(sys.modules.items()):  # the package modules this notebook imported: their code shapes its outputs
            f = getattr(m, '__file__', None)
            if (n == lib or n.startswith(lib+'.')) and f and Path(f).resolve().is_relative_to(root):
                p = Path(f).resolve().relative_to(root)
                deps[p.as_posix()] = _sha((root/p).read_bytes())
        outs = [self.outs.get(i, []) for i in range(len(self.code))]
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        self.cache_path.write_text(json.dumps(dict(key=self.key, deps=deps, seconds=round(time.time()-self.t0, 1),
                                                   outputs=outs)))

class DocsProcs(FilterDefaults):
    "nbdev's default processors, with `exec_all` in place of `exec_show_docs`, and method docs after class docs"
    def base_procs(self):
        res = []
        for p in super().base_procs():
            res.append(exec_all if p is exec_show_docs else p)
            if p is add_show_docs: res.append(add_method_docs)
        return res

def process_nb(path:Path, cache_path:Path):
    "The notebook at `path` processed as nbdev does for its docs, with every cell's outputs (run, or from the cache)"
    path = Path(path).resolve()
    nb = read_nb(path)
    nb.path_ = str(path)
    whole_description(nb)
    exec_all.nb_path, exec_all.cache_path = path, cache_path
    cwd = os.getcwd()
    os.chdir(path.parent)  # as in `nbdev_test`: notebooks run from their folder
    try: DocsProcs()(nb)
    finally: os.chdir(cwd)
    return nb
