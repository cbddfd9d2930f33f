"""Check the docs site: build it (tools/docs.py), look at every page's HTML, and render pages in headless Chromium.
`python tools/docs_check.py` exits 1, saying why, if the build fails, or a notebook has no page, or a page shows a
Python traceback or an unrendered `show_doc`, or an internal link points to a missing page or anchor, or a public
function, class or patched Learner method has no entry with its signature and docments, or a page's description
is cut short, or Chromium cannot render a page. Screenshots go to `_proc/screenshots/` (PNG).
Chromium: Debian's `chromium` (`apt-get install chromium`), run with no network and a fresh profile."""
import argparse, html, importlib, inspect, json, re, shutil, subprocess, sys, tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit, unquote
from nbdev.config import get_config
from nbdev.doclinks import nbglob, _nbpath2html

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs

SHOTS = {'index.html': ('index.png', 2200), 'mixed_precision.html': ('mixed_precision.png', 2200),
         'monitor.html': ('monitor.png', 7000)}  # page: (screenshot, window height); monitor's whole page has a plot

class Page(HTMLParser):
    "The ids, links, text and tracebacks of one HTML page"
    def __init__(self, txt):
        super().__init__()
        self.ids, self.links, self.text, self.errors, self._skip = set(), [], [], 0, 0
        self.feed(txt)
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if 'id' in a: self.ids.add(a['id'])
        if tag == 'a' and a.get('href'): self.links.append(a['href'])
        if tag == 'img' and a.get('src'): self.links.append(a['src'])  # a plot is a file next to the page
        if re.search(r'\b(traceback|output error)\b', a.get('class') or ''): self.errors += 1
        if tag in ('script', 'style'): self._skip += 1
    def handle_endtag(self, tag):
        if tag in ('script', 'style'): self._skip -= 1
    def handle_data(self, d):
        if not self._skip: self.text.append(d)

def _squash(s:str)->str:
    "Text for comparing: Sphinx's curly quotes straight, no whitespace (the HTML splits text around inline code)"
    return re.sub(r'\s+', '', s.translate(str.maketrans('‘’“”', "''\"\"")))

def _plain(md:str)->str:
    "Markdown as the text a reader sees: links' text, no backticks"
    return re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', md).replace('`', '')

def check_pages(docs_dir:Path, pages:dict)->list:
    "Problems in the built HTML; `pages` maps each notebook to its page"
    probs, parsed = [], {}
    for f in sorted(docs_dir.rglob('*.html')):
        if '_static' not in f.parts: parsed[f.relative_to(docs_dir).as_posix()] = Page(f.read_text())
    for nb,h in pages.items():
        if h not in parsed: probs.append(f'{nb.name}: no page {h}'); continue
        p, text = parsed[h], ' '.join(' '.join(parsed[h].text).split())
        if p.errors or 'Traceback (most recent call last)' in text: probs.append(f'{h}: shows a Python traceback')
        if re.search(r'show_doc\(|\{target=|#\| *(echo|output)', text): probs.append(f'{h}: an unrendered show_doc or quarto directive')
        m = re.search(r'^#\s.*\n+((?:>.*\n?)+)', _title_md(nb))
        if m and _squash(_plain(re.sub(r'^>\s*', '', m.group(1), flags=re.M))) not in _squash(text): probs.append(f'{h}: its description is cut short')
    for name,p in parsed.items():
        for href in p.links:
            u = urlsplit(href)
            if u.scheme or u.netloc or href.startswith('mailto:'): continue
            target = (Path(name).parent/unquote(u.path)).as_posix() if u.path else name
            target = re.sub(r'(^|/)[^/]+/\.\./', r'\1', target)
            if target not in parsed and not (docs_dir/target).exists(): probs.append(f'{name}: link to missing {href}')
            elif u.fragment and target in parsed and unquote(u.fragment) not in parsed[target].ids:
                probs.append(f'{name}: link to missing anchor {href}')
    return probs

def _title_md(nb:Path)->str:
    "The source of a notebook's first markdown cell (its title and description)"
    c = next((c for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'markdown'), None)
    return ''.join(c['source']) if c else ''

def check_api(docs_dir:Path)->list:
    """Every public function and class of the package, and every method it patches onto another class (`Learner.to_half`),
    has an entry on its page with its signature and each of its docments"""
    from fastcore.docments import docments
    cfg, probs = get_config(), []
    syms = importlib.import_module(f'{cfg.lib_name}._modidx').d['syms']
    for mod, entries in syms.items():
        m = importlib.import_module(mod)
        for full, (url, _) in entries.items():
            parts = full[len(mod)+1:].split('.')
            if any(p.startswith('_') for p in parts): continue
            if len(parts) == 1: obj = getattr(m, parts[0], None)
            elif parts[0] not in vars(m): obj = getattr(getattr(m, parts[0], None), parts[1], None)  # patched onto a class
            else: continue  # a method of our own class: documented when public and documented (tools/docs_nb.py)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)): continue
            page, anchor = url.split('#')
            f = docs_dir/page
            src = f.read_text() if f.exists() else ''
            i = src.find(f'id="{anchor}"')
            if i < 0: probs.append(f'{full}: no entry #{anchor} on {page}'); continue
            seg = src[i:]
            hrs = [h.start() for h in re.finditer('<hr', seg)]  # the entry ends at the next show_doc's rule
            seg = seg[:hrs[1]] if len(hrs) > 1 else seg
            sigs = [html.unescape(re.sub(r'<[^>]+>', '', s)) for s in re.findall(r'<pre[^>]*>(.*?)</pre>', seg, re.S)]
            sig = next((s for s in sigs if re.search(rf'\b(def|class) {re.escape(parts[-1])}\(', s)), None)
            if sig is None: probs.append(f'{full}: no signature on {page}#{anchor}'); continue
            for arg, doc in (docments(obj, full=False) or {}).items():
                if doc and arg != 'return' and ' '.join(doc.split()) not in ' '.join(sig.split()):
                    probs.append(f'{full}: docment of {arg} missing on {page}')
    return probs

def chromium()->str:
    exe = shutil.which('chromium') or shutil.which('chromium-browser')
    if not exe: sys.exit('docs check: no chromium; install it with `apt-get install -y chromium`')
    return exe

def render(docs_dir:Path, out:Path)->list:
    "Screenshot pages in headless Chromium and read the DOM its scripts left; problems found"
    exe, probs = chromium(), []
    out.mkdir(parents=True, exist_ok=True)
    for page, (png, height) in SHOTS.items():
        url = (docs_dir/page).resolve().as_uri()
        with tempfile.TemporaryDirectory() as prof:  # a fresh profile per page: nothing cached or remembered
            base = [exe, '--headless', '--no-sandbox', '--disable-gpu', f'--user-data-dir={prof}', '--hide-scrollbars',
                    '--host-resolver-rules=MAP * ~NOTFOUND', '--no-first-run', f'--window-size=1400,{height}',
                    '--virtual-time-budget=5000']
            r = subprocess.run(base + [f'--screenshot={out/png}', url], capture_output=True, text=True, timeout=120)
            dom = subprocess.run(base + ['--dump-dom', url], capture_output=True, text=True, timeout=120).stdout
        if r.returncode or not (out/png).exists() or (out/png).stat().st_size < 20_000:
            probs.append(f'{page}: Chromium made no screenshot (rc {r.returncode}): {r.stderr[-500:]}'); continue
        if 'sidebar-tree' not in dom or 'class="highlight' not in dom: probs.append(f'{page}: rendered without sidebar or code')
        if page != 'index.html' and '<hr' not in dom: probs.append(f'{page}: no show_doc entry rendered')
        print(f'screenshot: {out/png}')
    return probs

def main():
    ap = argparse.ArgumentParser(description='Build the docs site and check it, in HTML and in headless Chromium')
    ap.add_argument('--clean', action='store_true', help='build from scratch (tools/docs.py --force)')
    ap.add_argument('--no-build', action='store_true', help='check the site already in _docs/')
    a = ap.parse_args()
    cfg = get_config()
    root, docs_dir = cfg.config_path, cfg.config_path/cfg.doc_path
    if not a.no_build and docs.build(force=a.clean) != 0: sys.exit('docs check: the build failed')
    pages = {p: _nbpath2html(p.relative_to(cfg.nbs_path)).as_posix() for p in sorted(nbglob(cfg.nbs_path, as_path=True))}
    probs = check_pages(docs_dir, pages) + check_api(docs_dir) + render(docs_dir, root/'_proc'/'screenshots')
    for p in probs: print('PROBLEM', p)
    if probs: sys.exit(f'docs check: {len(probs)} problem(s)')
    print(f'docs check: {len(pages)} pages built and checked, every link and anchor found, screenshots rendered')

if __name__ == '__main__': main()
