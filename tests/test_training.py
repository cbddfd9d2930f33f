"Issue 2: the callbacks inside real fits"
import math
import torch, torch.nn as nn, pytest
from sklearn.datasets import load_digits
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai_fp16.all import *
from helpers import *

def test_nvidia_recipe_equals_learner():
    "The recipe by hand (fp16 Linear, fp32 master, static scale 128, SGD) and our callbacks give the same weights"
    N, lr, steps = 64, 1e-2, 10
    lin, x, y, master_params = recipe_by_hand(torch.optim.SGD, steps, lr, N)
    learn = Learner(dls_from(torch.cat([x, x[:16]]), torch.cat([y, y[:16]]), bs=N), lin, loss_func=nn.MSELoss(), opt_func=SGD)
    learn.to_half('fp16', init_scale=128, dynamic=False)
    learn.fit(steps, lr)
    assert learn.mixed_precision.scales == [128.]*steps
    for a, b in zip(learn.model.parameters(), master_params): assert torch.equal(a, b)

def test_flat_master_is_retired_with_a_clear_error():
    with pytest.raises(ValueError, match='flat_master=True was retired'): Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16', flat_master=True)

class _OptState(Callback):
    "Adam's per-param state as the optimizer holds it at the last step of the fit"
    order = 20
    def after_step(self): self.state = [[s[k].clone() for k in ('grad_avg', 'sqr_avg')] for s in self.learn.opt.state_dict()['state']]

def test_channels_last_params_grads_and_state():
    "A channels_last bf16 conv net: its params, their fp32 grads and Adam's state stay channels_last, and it trains"
    x, y = torch.rand(48, 3, 16, 16), torch.randint(0, 2, (48,))
    torch.manual_seed(0); st = _OptState()
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(dls_from(x, y, bs=8), model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, cbs=st)
    learn.to_half(torch.bfloat16, channels_last=True)
    w = params(learn)
    learn.fit(1, 1e-2)
    cl = lambda t: t.is_contiguous(memory_format=torch.channels_last)
    assert cl(learn.model[0].weight) and cl(learn.model[3].weight)
    assert all(a.stride() == p.stride() for p, s in zip(learn.model.parameters(), st.state) for a in s)
    assert any(not torch.equal(a, b) for a, b in zip(w, params(learn))) and fp32_everywhere(learn)

def test_growth_after_interval():
    learn = Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16', init_scale=4., growth_interval=2)
    learn.fit(1, 1e-3)
    assert learn.mixed_precision.scales == [4., 4., 8., 8., 16., 16.]

def test_clip_bounds_master_grad_norm():
    spy = StepSpy()
    learn = Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), cbs=spy).to_half('fp16', clip=0.05)
    learn.fit(1, 1e-2)
    # the device decides to skip (fastai's `Adam`, fused): a callback after ours sees every step, a skipped one's grads inf/NaN
    ran = [n for n in spy.norms if math.isfinite(n)]
    assert spy.steps == 6 and len(ran) == 6 - learn.mixed_precision.skipped and len(ran) >= 4
    assert max(ran) <= 0.05 * (1 + 1e-4)
    spy2 = StepSpy()
    Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), cbs=spy2).to_half('fp16').fit(1, 1e-2)
    assert max(spy2.norms) > 0.05  # so the clip did something

def test_after_fit_state():
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam).to_half('fp16')
    learn.fit(1, 1e-2)
    assert fp32_everywhere(learn) and opt_on_model(learn)
    for cb in (learn.model_to_half, learn.mixed_precision):
        assert not (set(cb._stateattrs) - {'scales'}) & set(cb.__dict__), cb
    assert not learn.model._state_dict_hooks  # the checkpoint hook is gone

def test_loss_decreases_on_digits():
    "A real small task (scikit-learn's digits) in fp16 with fp32 masters learns"
    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32)/16, torch.tensor(d.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    learn = Learner(dls_from(x, y, bs=64, n_valid=297), model, loss_func=CrossEntropyLossFlat(), metrics=accuracy).to_half('fp16')
    before = learn.validate()[0]
    learn.fit(3, 1e-2)
    loss, acc = learn.validate()
    assert loss < before/3 and acc > 0.85, (before, loss, acc)

def test_bf16_conv_net_trains():
    x, y = torch.rand(48, 3, 16, 16), torch.randint(0, 2, (48,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    learn = Learner(dls_from(x, y, bs=8), model, loss_func=CrossEntropyLossFlat()).to_half(torch.bfloat16)
    w = params(learn)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn)
    assert any(not torch.equal(a, b) for a, b in zip(w, params(learn)))

def test_recorded_loss_is_unscaled():
    class LossSpy(Callback):
        order = 100
        def before_fit(self): self.losses = []
        def after_batch(self):
            if self.training: self.losses.append(self.learn.loss.item())
    runs = []
    for half in (False, True):
        spy = LossSpy()
        learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=spy)
        if half: learn.to_half('fp16', init_scale=2.**10, dynamic=False)
        learn.fit(1, 1e-2)
        runs.append((spy.losses, learn.recorder.losses[-1].item()))
    (l32, r32), (l16, r16) = runs
    assert all(abs(a - b) < 0.05 * a for a, b in zip(l32, l16)), (l32, l16)  # same magnitude, not x1024
    assert abs(r32 - r16) < 0.05 * r32

def test_non_affine_batchnorm_stays_fp32():
    class Seen(Callback):
        order = 15
        def before_step(self): self.dtypes = (self.model[1].running_var.dtype, self.model[1].weight)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, affine=False), nn.ReLU(), nn.Linear(8, 2))
    rv = model[1].running_var.clone()
    seen = Seen()
    learn = Learner(synth_dls(), model, loss_func=nn.MSELoss(), cbs=seen).to_half('fp16')
    learn.fit(1, 1e-2)
    assert seen.dtypes == (torch.float32, None)
    assert model[1].running_var.dtype == torch.float32 and not torch.equal(model[1].running_var, rv)

def test_fine_tune():
    "fastai's fine_tune: frozen body untouched (bit for bit) in the first fit, trained after unfreeze"
    import fastai.callback.schedule  # fine_tune, fit_one_cycle
    m = tiny_model()
    groups = [list(m[:3].parameters()), list(m[3].parameters())]
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), splitter=lambda _: groups).to_half('fp16')
    body0 = [p.detach().clone() for p in m[0].parameters()]
    class BodySpy(Callback):
        order = 100
        def after_fit(self): self.body = getattr(self, 'body', []) + [[p.detach().clone() for p in m[0].parameters()]]
    spy = BodySpy(); learn.add_cb(spy)
    learn.fine_tune(1, 1e-2, freeze_epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(spy.body[0], body0))
    assert not torch.equal(spy.body[1][0], body0[0]) and fp32_everywhere(learn) and opt_on_model(learn)

@pytest.mark.parametrize('half', [False, True])
def test_unused_params_are_not_stepped(half):
    "A param that gets no grad (an unused head, a GAN's idle half) is skipped by the optimizer, as in fp32"
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__(); self.body, self.idle = tiny_model(), nn.Linear(4, 2)
        def forward(self, x): return self.body(x)
    m = TwoHeads(); idle0 = [p.detach().clone() for p in m.idle.parameters()]
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), opt_func=Adam, wd=0.1)
    if half: learn.to_half('fp16')
    learn.fit(2, 1e-2)
    assert all(torch.equal(a, b) for a, b in zip(m.idle.parameters(), idle0))

class _Sometimes(nn.Module):
    "tiny_model plus a head that is used only while `use_idle` is set"
    def __init__(self):
        super().__init__(); self.body, self.idle, self.use_idle = tiny_model(), nn.Linear(4, 2), True
    def forward(self, x): return self.body(x) + self.idle(x) if self.use_idle else self.body(x)

class _FirstBatchOnly(Callback):
    "The idle head gets a grad in the first step only; its weight is recorded after every step"
    order = 20  # after MixedPrecision.after_step has copied the masters into the model
    def before_fit(self): self.ws = []
    def before_batch(self): self.model.use_idle = self.training and self.iter == 0 and self.epoch == 0
    def after_step(self): self.ws.append(self.model.idle.weight.detach().float().clone())

def test_params_that_stop_getting_grads_step_as_in_fp32():
    "fastai zeroes grads in place, so a param that had a grad keeps stepping on zeros (Adam momentum, wd): ours too"
    runs = []
    for half in (False, True):
        torch.manual_seed(0); rec = _FirstBatchOnly()
        learn = Learner(synth_dls(), _Sometimes(), loss_func=nn.MSELoss(), opt_func=Adam, wd=0.1, cbs=rec)
        if half: learn.to_half('fp16', init_scale=128, dynamic=False)  # no skipped first step
        learn.fit(2, 1e-2)
        runs.append(rec.ws)
    (fp32, ours) = runs
    assert len(ours) == len(fp32) > 2 and not torch.equal(fp32[-1], fp32[0])  # fp32 keeps moving it...
    assert not torch.equal(ours[-1], ours[0])  # ...and so do we
    assert torch.allclose(ours[-1], fp32[-1], atol=2e-3), (ours[-1] - fp32[-1]).abs().max()

def test_retired_keep_master_grads_says_so():
    "The grads' buffers between steps were retired with the half copies: autograd accumulates into the params' own"
    with pytest.raises(ValueError, match='keep_master_grads was retired'): MixedPrecision(keep_master_grads=True)

@pytest.mark.parametrize('mix', ['MixUp', 'CutMix'])
@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_mixup_with_half_loss(mix, dtype):
    "Issue 14.6: MixUp/CutMix with loss_fp32=False: torch.lerp mixes half losses with a weight in their dtype"
    import fastai.callback.mixup as mixup
    x, y = torch.rand(48, 3, 8, 8), torch.randint(0, 3, (48,))
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    learn = Learner(dls_from(x, y, bs=8), m, loss_func=CrossEntropyLossFlat(), cbs=getattr(mixup, mix)())
    learn.to_half(dtype, loss_fp32=False, init_scale=256.)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn)
    assert all(torch.isfinite(torch.tensor(v)) for v in learn.recorder.values[-1])

class _Count(nn.Module):
    "Counts its training forwards in a float buffer from 256, where bf16 can no longer add 1"
    def __init__(self): super().__init__(); self.register_buffer('n', torch.tensor(256.)); self.lin = nn.Linear(4, 4)
    def forward(self, x):
        if self.training: self.n += 1
        return self.lin(x)

def _Seen():  # in flight: the dtype each layer computes in
    return [InForward(lambda m: m[0].lin, lambda l, o: o.dtype), InForward(lambda m: m[1][0], lambda l, o: o.dtype)]

@pytest.mark.parametrize('keep', [None, '0.n', '0', _Count])
def test_keep_fp32_keeps_updated_buffers_exact(keep):
    "Issue 14.6: a float buffer the forward updates in place counts exactly (the model's own fp32 buffer), kept fp32 by name or class or not"
    spy = _Seen()
    learn = Learner(synth_dls(), nn.Sequential(_Count(), tiny_model()), loss_func=nn.MSELoss(), cbs=spy)
    learn.to_half('bf16', keep_fp32=keep).fit(2, 1e-2)   # 3 training batches per epoch
    n = learn.model[0].n
    assert n.dtype == torch.float32 and n == 262.
    assert [s.seen for s in spy] == [{torch.float32 if keep in ('0', _Count) else torch.bfloat16}, {torch.bfloat16}]  # a kept module runs fp32
    assert fp32_everywhere(learn) and not any(m._forward_hooks or m._forward_pre_hooks for m in learn.model.modules())

def test_keep_fp32_unknown_name_is_a_clear_error():
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16', keep_fp32=['body.ema'])
    with pytest.raises(ValueError, match="'body.ema' names no module, parameter or buffer"): learn.fit(1)
    assert fp32_everywhere(learn)
