"fastai's optimizers under `to_half`: each steps the fp32 masters as it steps fp32 weights, wrappers' own logic included"
from functools import partial
import torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.optimizer import Adam, Lookahead, ranger, Lamb, Larc, QHAdam, RMSProp, SGD
from fastai_fp16.all import *

OPTS = dict(adam=Adam, lookahead_adam=lambda *a, **k: Lookahead(Adam(*a, **k)), ranger=ranger, lamb=Lamb, larc=Larc,
            qhadam=QHAdam, rmsprop=RMSProp, sgd_mom=partial(SGD, mom=0.9))

class SeenFused(Callback):
    order = 100
    def before_step(self): self.seen = getattr(self.learn, 'mixed_precision', None) and self.mixed_precision.fused

def moved(opt_func, dtype=None):
    """Mean |w_end - w_start| after an epoch at lr 1e-6 (8 steps: past Lookahead's k=6). Each update is far below a half
    ulp, so the weights move only through the fp32 masters: what their optimizer did to them"""
    learn = Learner(synth_dls(n=160, bs=16), tiny_model(), loss_func=nn.MSELoss(), opt_func=opt_func, cbs=(sf := SeenFused()))
    if dtype: learn.to_half(dtype, init_scale=256., dynamic=False)  # a scale that never overflows here
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-6)
    if dtype: assert learn.mixed_precision.skipped == 0
    return torch.cat([(p.detach() - q).abs().reshape(-1) for p,q in zip(learn.model.parameters(), w0)]).mean().item(), sf

@pytest.mark.parametrize('name', OPTS)
def test_masters_move_as_fp32(name):
    ref, _ = moved(OPTS[name])
    assert ref > 0
    for dtype in ('bf16', 'fp16'):
        d, sf = moved(OPTS[name], dtype)
        assert abs(d / ref - 1) < 0.2, f"{name} {dtype}: moved {d:.3g}, fp32 {ref:.3g}"
        assert sf.seen == (name in ('adam', 'lookahead_adam'))  # Lookahead's inner Adam steps fused, inside its own step
