"Which `ModelToHalf`/`MixedPrecision` a user gets after each order of star imports, and that `learn.to_half()` is ours in both (issue 34.8)"
import os, sys, subprocess, json
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, torch.nn as nn
from fastai.learner import Learner
from fastai_fp16.core import synth_dls, tiny_model
learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half()
pkg = lambda c: c.__module__.split('.')[0]  # 'fastai' or 'fastai_fp16'
print(json.dumps(dict(names={n: pkg(globals()[n]) for n in ('ModelToHalf', 'MixedPrecision')},
                      to_half=sorted({pkg(type(cb)) for cb in learn.cbs if 'Half' in type(cb).__name__ or 'Precision' in type(cb).__name__}))))
"""

@pytest.mark.parametrize('first,last', [('fastai.vision.all', 'fastai_fp16.all'), ('fastai_fp16.all', 'fastai.vision.all')])
def test_names_after_each_import_order(first, last):
    code = f"from {first} import *\nfrom {last} import *\n" + PROBE
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # the names are the last star import's: ours only when fastai_fp16.all comes after fastai's, as the README imports
    want = 'fastai_fp16' if last == 'fastai_fp16.all' else 'fastai'
    assert got['names'] == {'ModelToHalf': want, 'MixedPrecision': want}, got
    assert got['to_half'] == ['fastai_fp16'], got  # `learn.to_half()` adds ours whatever the names are
