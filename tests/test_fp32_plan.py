"Issue 54: where `to_half('auto')` plans fp32 (a CPU without fast half kernels), the fit keeps every promise of a half fit: a NaN/inf batch skipped with the model untouched, the skip line, `LossScaleError` on a collapse, at one host read a step, no casts, no scaling"
import warnings, pytest, torch, torch.nn as nn
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai_fp16.all import *
from fastai_fp16.core import synth_dls, tiny_model
from helpers import params
from helpers import SyncCount

classes = list(cpu_classes) + ['other']
def caps(cls): return cpu_caps(cls) if cls in cpu_classes else Capabilities('cpu', 'a CPU without AVX2')

class NaNBatch(Callback):
    "Training batch `at` of each epoch gets a NaN input"
    order = -1
    def __init__(self, at=1): self.at = at
    def before_batch(self):
        if self.training and self.iter == self.at: self.learn.xb = (self.xb[0] * float('nan'),)

class Snap(Callback):
    "The model's params and float buffers after each training batch"
    order = 100
    def before_fit(self): self.w = []
    def after_batch(self):
        if self.training: self.w.append([t.detach().clone() for t in list(self.model.parameters()) + list(self.model.buffers())])

def fit(learn, cls, epochs=1, lr=1e-2):
    with assume_capabilities(caps(cls)), learn.no_bar(): learn.fit(epochs, lr)
    return learn

def test_auto_plans_fp32_on_the_classes_without_fast_half_kernels():
    assert {c for c in classes if plan_precision(caps(c), 'auto').dtype == torch.float32} == {'avx512', 'avx2', 'other'}

@pytest.mark.parametrize('cls', classes)
def test_a_nan_batch_is_skipped_with_the_model_untouched(cls, capsys):
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[NaNBatch(1), s := Snap()]).to_half('auto')
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always'); fit(learn, cls)
    w = s.w
    assert all(torch.equal(a, b) for a, b in zip(w[0], w[1]))  # the NaN step: params and BatchNorm's stats as before it
    assert all(torch.isfinite(t).all() for t in w[-1]) and any(not torch.equal(a, b) for a, b in zip(w[1], w[2]))  # later steps train
    mp = learn.mixed_precision
    assert (mp.skipped, mp.skipped_bad_loss) == (1, 1)
    assert 'fastai_fp16: 1 optimizer step skipped: 1 on an inf/NaN loss' in capsys.readouterr().out
    assert any('the loss was inf or NaN at epoch 0, batch 1' in str(x.message) for x in ws)

def test_plain_fp32_is_ruined_by_the_same_batch():
    "What the fp32 plan protects against: without `to_half`, the same NaN batch makes every weight NaN"
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[NaNBatch(1), s := Snap()])
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    assert all(torch.isnan(p).all() for p in s.w[-1][:4])  # the two linear layers' weights and biases

def inf_loss(pred, y): return nn.functional.mse_loss(pred, y) * float('inf')

@pytest.mark.parametrize('cls', classes)
def test_a_collapse_raises(cls):
    learn = Learner(synth_dls(), tiny_model(), loss_func=inf_loss).to_half('auto', max_consecutive_skips=3)
    w = params(learn)
    with pytest.raises(LossScaleError, match='3 optimizer steps in a row were skipped'): fit(learn, cls)
    assert all(torch.equal(a, b) for a, b in zip(w, params(learn)))
    if plan_precision(caps(cls), 'auto').dtype == torch.float32:  # the fp32 plan's advice: no fp32 to fall back to
        with pytest.raises(LossScaleError, match=r"to_half\('auto', clip=1\.\)`; capping large losses \(`soft_cap`\); looking for inf/NaN in the data\.$"):
            fit(Learner(synth_dls(), tiny_model(), loss_func=inf_loss).to_half('auto', max_consecutive_skips=3), cls)

def test_plain_fp32_trains_on_silently_with_an_inf_loss():
    learn = Learner(synth_dls(), tiny_model(), loss_func=inf_loss)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)  # no error: the weights are NaN
    assert any(torch.isnan(p).any() for p in learn.model.parameters())

class Inside(Callback):
    "What the fp32 plan's steps run: the forward's weights, the loss backward started from, the window"
    order = 20
    def before_fit(self): self.seen = set()
    def after_pred(self):
        if self.training: self.seen.add(('weights', self.model[0].weight.dtype, self.learn.model_to_half._run is None))
    def after_backward(self): self.seen.add(('loss', bool(torch.equal(self.learn.loss_grad, self.learn.loss))))

def test_the_fp32_plan_reads_the_host_once_a_step_and_neither_casts_nor_scales():
    sc = SyncCount()
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[sc, ins := Inside()]).to_half('auto')
    with assume_capabilities(cpu_caps('avx2')), learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    assert sc.steps == 6 and sc.n == sc.steps + 1  # one a step; and once a fit, the buffers a forward changes
    assert ins.seen == {('weights', torch.float32, True), ('loss', True)}  # no casts, no window; the loss not multiplied
    mp = learn.mixed_precision
    assert set(mp.scales) == {1.} and (mp.loss_scale, mp.scaler.dynamic) == (1., False)
    sd = mp.state_dict()
    assert sd['dtype'] == 'torch.float32'
    mp2 = MixedPrecision(); mp2.load_state_dict(sd)  # its checkpoint loads
    assert (mp2.loss_scale, mp2.scaler.dynamic) == (1., False)

def test_the_fp32_plan_clips_as_asked():
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[n := Norm()]).to_half('auto', clip=1e-3)
    with assume_capabilities(cpu_caps('avx2')), learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    assert n.norms and max(n.norms) <= 1e-3 * 1.001

class Norm(Callback):
    order = 15  # after MixedPrecision.before_step, which clips
    def before_fit(self): self.norms = []
    def before_step(self):
        self.norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None])).item())
