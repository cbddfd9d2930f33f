"The modules of fastai_fp16 import one another without a cycle, counting imports inside functions too"
import ast
from pathlib import Path
import fastai_fp16

PKG = Path(fastai_fp16.__file__).parent

def _imported(path:Path)->set:
    "The fastai_fp16 modules that module `path` imports, anywhere in it (`from .x import`, `from fastai_fp16.x import`, `import fastai_fp16.x`)"
    res = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ''
            if node.level == 1: names = [mod] if mod else [a.name for a in node.names]  # `from . import x`: x
            elif mod == 'fastai_fp16': names = [a.name for a in node.names]
            elif mod.startswith('fastai_fp16.'): names = [mod[len('fastai_fp16.'):]]
            else: names = []
        elif isinstance(node, ast.Import): names = [a.name[len('fastai_fp16.'):] for a in node.names if a.name.startswith('fastai_fp16.')]
        else: names = []
        res |= {n.split('.')[0] for n in names if (PKG/f"{n.split('.')[0]}.py").exists()}
    return res - {path.stem}

def import_graph()->dict: return {p.stem: _imported(p) for p in sorted(PKG.glob('*.py')) if p.stem != '__init__'}

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
    f = tmp_path/'mod.py'
    f.write_text("from .core import x\nimport fastai_fp16.scaler\nfrom fastai_fp16.monitor import y\n"
                 "def f():\n    from fastai_fp16.cli import z\nfrom . import bench\nimport os\n")
    assert _imported(f) == {'core', 'scaler', 'monitor', 'cli', 'bench'}

def test_no_import_cycle():
    g = import_graph()
    assert {'cli', 'bench', 'callbacks', 'core'} <= set(g) and 'core' in g['callbacks']  # the graph was read
    assert find_cycle(g) is None, f"import cycle: {' -> '.join(find_cycle(g))}"
