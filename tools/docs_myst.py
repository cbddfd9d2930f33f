"""A notebook processed by nbdev (written for quarto) as a notebook MyST-NB renders: quarto's syntax in MyST's."""
import re
from docutils.nodes import make_id

_dir = re.compile(r'^#\|\s*([\w-]+)\s*:\s*(.*?)\s*$')
_tags = {('echo', 'false'): 'remove-input', ('output', 'false'): 'remove-output', ('include', 'false'): 'remove-cell',
         ('code-fold', 'true'): 'hide-input'}
_callout = re.compile(r'^(:{3,})\s*\{\.callout-(\w+)([^}]*)\}\s*$', re.M)
_kinds = {'note', 'tip', 'warning', 'important', 'caution'}

def _callouts(md:str)->str:
    "quarto's `::: {.callout-KIND title=..}` as MyST's `:::{KIND}` (or `:::{admonition} title` with its class)"
    def f(m):
        fence, kind, attrs = m.groups()
        kind = kind if kind in _kinds else 'note'
        t = re.search(r'title\s*=\s*"([^"]*)"', attrs)
        return f'{fence}{{admonition}} {t.group(1)}\n:class: {kind}' if t else f'{fence}{{{kind}}}'
    return _callout.sub(f, md)

class Links:
    "Site links as relative ones: nbdev's links to the published site, and links to `NN_name.ipynb` notebooks"
    def __init__(self, site:str, pages:dict, here:str='index.html'):  # pages: nb name -> html; here: this page's html
        self.site, self.pages = site.rstrip('/') + '/', pages
        self.up = '../' * here.count('/')  # from a page in a folder (`study/claims.html`) to the site's root
    def _nb(self, m)->str:
        h = self.pages.get(m.group(1).split('/')[-1])
        return f']({m.group(1) if h is None else self.up + h}{m.group(2) or ""})'
    def __call__(self, md:str)->str:
        md = md.replace(f']({self.site}', f']({self.up}')
        return re.sub(r'\]\((?![a-z]+:)([^)\s#]+\.ipynb)(#[^)\s]*)?\)', self._nb, md)

def show_doc_md(md:str)->str:
    "show_doc's quarto markdown in MyST: its rule and right-floated source link as HTML, an anchor nbdev's links find"
    md = re.sub(r'^---\s*\n', '<hr>\n\n', md)
    # nbdev links names line by line, in the signature's code block too, where a link shows as raw markdown
    md = re.sub(r'^```.*?^```', lambda m: re.sub(r'\[(`[^`]+`)\]\([^)\s]*\)', r'\1', m.group(0)), md, flags=re.M|re.S)
    md = re.sub(r'^```python\n', '```{code-block} python\n:class: signature\n', md, flags=re.M)  # for docs.css
    md = re.sub(r'\[source\]\(([^)]*)\)\{[^}]*\}',
                r'<a class="sd-source" href="\1" target="_blank" style="float:right; font-size:smaller">source</a>', md)
    def anchor(m):  # nbdev links to `#name.lower()`; docutils' own id for the heading drops `.` and `_`
        nm = m.group(2).strip('`')
        return m.group(0) if make_id(nm) == nm.lower() else f'<div id="{nm.lower()}"></div>\n\n{m.group(0)}'
    return re.sub(r'^(#+)\s+(\S+)\s*$', anchor, md, count=1, flags=re.M)

def _src(c): return c.source if isinstance(c.source, str) else ''.join(c.source)
def _md(text:str, i:int)->dict: return dict(cell_type='markdown', id=f'md{i}', metadata={}, source=text)

def to_myst(nb, links:Links, toctree:list|None=None)->dict:
    "nbformat dict of `nb` (processed by `docs_nb.process_nb`) for MyST-NB; `toctree`: the pages an index lists, as (caption, pages) groups"
    fm, cells = getattr(nb, 'frontmatter_', {}), []
    for i,c in enumerate(nb.cells):
        src = _src(c)
        if c.cell_type == 'raw':
            if src.startswith('---') and fm.get('title'):  # the front matter nbdev made from the title cell
                desc = f"\n\n> {links(fm['description'])}" if fm.get('description') else ''
                cells.append(_md(f"# {fm['title']}{desc}", i))
            continue
        if c.cell_type == 'markdown': cells.append(_md(_callouts(links(src)), i)); continue
        lines, tags = src.splitlines(), []
        while lines and (m := _dir.match(lines[0])):
            if (t := _tags.get((m.group(1), m.group(2).lower()))): tags.append(t)
            lines.pop(0)
        outs = [dict(o) for o in c.get('outputs', [])]
        for o in outs:
            if 'text/markdown' in o.get('data', {}):
                o['data'] = {**o['data'], 'text/markdown': links(''.join(o['data']['text/markdown']))}
        sd = [o['data']['text/markdown'] for o in outs if 'text/markdown' in o.get('data', {})]
        if lines and re.match(r'show_doc\(', lines[0]) and sd:  # a show_doc: its markdown is part of the page
            cells.append(_md(show_doc_md(sd[0]), i)); continue
        cells.append(dict(cell_type='code', id=c.get('id') or f'code{i}', metadata={'tags': tags} if tags else {},
                          execution_count=None, outputs=outs, source='\n'.join(lines)))
    for j, (caption, docs) in enumerate(toctree or []):  # the site's navigation, a group each
        cells.append(_md(f'```{{toctree}}\n:hidden:\n:maxdepth: 1\n:caption: {caption}\n\n' + '\n'.join(docs) + '\n```', len(nb.cells) + j))
    return dict(nbformat=4, nbformat_minor=5, cells=cells,
                metadata=dict(kernelspec=dict(name='python3', display_name='Python 3', language='python'),
                              language_info=dict(name='python', pygments_lexer='ipython3')))
