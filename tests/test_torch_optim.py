"Issue 14.5: torch optimizers through fastai's OptimWrapper, with fp32 masters"
import torch, torch.nn as nn, pytest, tempfile
from functools import partial
from pathlib import Path
from fastai.learner import Learner
from fastai.optimizer import OptimWrapper
from fastai.callback.core import Callback
from fastai.callback.tracker import SaveModelCallback
import fastai.callback.schedule  # lr_find
from fastai_fp16.all import *
from helpers import *

AdamW = partial(OptimWrapper, opt=torch.optim.AdamW)

def test_adamw_equals_the_recipe_by_hand():
    "torch's AdamW stepping fp32 masters by hand (fp16 Linear, static scale 128) and through OptimWrapper: the same weights"
    N, lr, steps = 64, 1e-2, 8
    lin, x, y, master_params = recipe_by_hand(torch.optim.AdamW, steps, lr, N)
    learn = Learner(dls_from(torch.cat([x, x[:16]]), torch.cat([y, y[:16]]), bs=N), lin, loss_func=nn.MSELoss(), opt_func=AdamW)
    learn.to_half('fp16', init_scale=128, dynamic=False)
    learn.fit(steps, lr)
    for a, b in zip(learn.model.parameters(), master_params): assert torch.equal(a, b)
    assert fp32_everywhere(learn) and opt_on_model(learn)
    st = learn.opt.opt.state
    assert all(st[p]['exp_avg'].dtype == torch.float32 and st[p]['step'] == steps for p in learn.model.parameters())

@pytest.mark.parametrize('kw', [dict(), dict(foreach=True), dict(fused=True)])
def test_foreach_and_fused_train(kw):
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=partial(OptimWrapper, opt=torch.optim.AdamW, **kw)).to_half('bf16')
    w = params(learn)
    learn.fit(2, 1e-2)
    assert fp32_everywhere(learn) and opt_on_model(learn) and all(not torch.equal(a, b) for a, b in zip(w, params(learn)))

def test_resume_from_save_model_callback():
    tmp = Path(tempfile.mkdtemp())
    def mk(): return Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=AdamW, path=tmp).to_half('fp16', growth_interval=4)
    a = mk()
    a.fit(3, 1e-2, cbs=SaveModelCallback(every_epoch=True, with_opt=True))
    sd = torch.load(tmp/'models/model_0.pth', weights_only=False)
    assert 'mixed_precision' in sd['opt'] and len(sd['opt']['state']) == 6
    assert {v.dtype for s in sd['opt']['state'].values() for k, v in s.items() if k != 'step'} == {torch.float32}
    b = mk(); b.load('model_0')
    b.fit(3, 1e-2, start_epoch=1)
    for x, y in zip(params(a), params(b)): assert torch.equal(x, y)
    assert a.mixed_precision.state_dict() == b.mixed_precision.state_dict()

def test_lr_find_leaves_model_optimizer_and_scaler():
    learn = Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=AdamW).to_half('fp16')
    learn.fit(1, 1e-2)
    def opt_state(): return [(k, v.clone()) for s in learn.opt.state_dict()['state'].values() for k, v in sorted(s.items())]
    w, st, sc = params(learn), opt_state(), learn.mixed_precision.state_dict()
    learn.lr_find(num_it=10, show_plot=False)
    assert all(torch.equal(a, b) for a, b in zip(w, params(learn)))
    assert all(k == l and torch.equal(a, b) for (k, a), (l, b) in zip(st, opt_state()))
    assert learn.mixed_precision.state_dict() == sc and opt_on_model(learn)

def test_freeze_unfreeze_and_discriminative_lrs():
    m = tiny_model()
    groups = [list(m[:3].parameters()), list(m[3].parameters())]
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), opt_func=AdamW, splitter=lambda _: groups).to_half('fp16')
    body0 = [p.detach().clone() for p in m[0].parameters()]
    learn.freeze(); learn.fit(1, 1e-2)   # fastai trains BatchNorm in a frozen group (train_bn): the Linear is frozen
    assert all(torch.equal(a, b) for a, b in zip(m[0].parameters(), body0))
    learn.unfreeze()
    body0 = [p.detach().clone() for p in m[:3].parameters()]
    head0 = [p.detach().clone() for p in m[3].parameters()]
    learn.fit(1, lr=[0., 1e-2])   # group 0 at lr 0 does not move, not even by a rounding
    assert all(torch.equal(a, b) for a, b in zip(m[:3].parameters(), body0))
    assert all(not torch.equal(a, b) for a, b in zip(m[3].parameters(), head0))
    learn.fit(1, lr=1e-2)
    assert not torch.equal(m[0].weight, body0[0]) and fp32_everywhere(learn) and opt_on_model(learn)

class _Sometimes(nn.Module):
    def __init__(self):
        super().__init__(); self.body, self.idle, self.use_idle = tiny_model(), nn.Linear(4, 2), True
    def forward(self, x): return self.body(x) + self.idle(x) if self.use_idle else self.body(x)

class _FirstBatchOnly(Callback):
    order = 20
    def before_fit(self): self.ws = []
    def before_batch(self): self.model.use_idle = self.training and self.iter == 0 and self.epoch == 0
    def after_step(self): self.ws.append(self.model.idle.weight.detach().float().clone())

def test_params_that_stop_getting_grads_are_not_stepped():
    "torch's zero_grad sets grads to None, so a param without a grad is not stepped (no momentum, no wd): ours too"
    runs = []
    for half in (False, True):
        torch.manual_seed(0); rec = _FirstBatchOnly()
        learn = Learner(synth_dls(), _Sometimes(), loss_func=nn.MSELoss(), opt_func=AdamW, cbs=rec)
        if half: learn.to_half('fp16', init_scale=128, dynamic=False)
        learn.fit(2, 1e-2)
        runs.append(rec.ws)
    for ws in runs: assert len(ws) > 2 and torch.equal(ws[0], ws[-1])  # moved by the first step only
