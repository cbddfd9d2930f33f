"""Write README.md from nbs/index.ipynb: markdown cells as they are, code cells with their executed text output.
(nbdev_readme needs quarto, which cannot be installed offline; this renders the same notebook with execnb.)
Streams are shown as a terminal shows them (tools/term.py): a fit prints fastai's results table, not every bar frame.
`python tools/readme.py --check` exits 1 if README.md is not what the notebook gives."""
import sys, os
from pathlib import Path
try: from execnb.nbio import read_nb
except ImportError: from fastcore.nbio import read_nb  # execnb 0.3 moved it to fastcore
from execnb.shell import CaptureShell
from term import terminal_text

root = Path(__file__).resolve().parent.parent

def render(nb_path=root/'nbs'/'index.ipynb') -> str:
    nb = read_nb(nb_path)
    os.chdir(root/'nbs')
    CaptureShell().run_all(nb, exc_stop=True)
    out = []
    for c in nb.cells:
        src = c.source.strip()
        if c.cell_type == 'markdown': out.append(src); continue
        if src.startswith('#| hide') or not src: continue
        out.append(f"```python\n{src}\n```")
        texts = [''.join(o.get('data', {}).get('text/plain', '')) or terminal_text(''.join(o.get('text', ''))) for o in c.get('outputs', [])]
        texts = [t.strip() for t in texts if t.strip() and not t.lstrip().startswith('[')]  # progress/log lines: not docs
        if texts: out.append("    " + "\n    ".join("\n".join(texts).splitlines()))
    return "\n\n".join(out) + "\n"

if __name__ == '__main__':
    txt, readme = render(), root/'README.md'
    if '--check' in sys.argv:
        if readme.read_text() != txt: sys.exit("README.md is out of date with nbs/index.ipynb: run `python tools/readme.py` and commit.")
        print("README.md matches nbs/index.ipynb")
    else: readme.write_text(txt); print("wrote README.md")
