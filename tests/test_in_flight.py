"""In flight the model computes in half under torch.autocast (or op by op), its params its own fp32 ones throughout: each
weight's grad reaches its fp32 param in fp32's order, a user's write to the weights through `.data` lands at every event, and
ops that need one dtype and meet fp32 data compute in fp32 with the fp32 values, as under autocast, lean masters included."""
import weakref, warnings
import torch, torch.nn as nn, torch.nn.functional as F, pytest
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai_fp16.all import *
from helpers import *

def mlp(): torch.manual_seed(0); return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

def fit(learn, n=1, lr=1e-2, **kw):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(n, lr, **kw)
    return learn

class Backward(Callback):
    "The order in which, in each training batch's backward, the fp32 weights get their grads (`('w', k)`) and layer k's output its grad (`('out', k)`), and the grads' dtypes"
    order = 20
    def before_fit(self):
        self.order_, self.dts, self.hs = [], set(), []
        for k, m in enumerate(self.learn.model[::2]):
            self.hs.append(m.register_forward_hook(lambda m, a, o, k=k: self._out(k, o)))
            self.hs.append(m.weight.register_hook(lambda g, k=k: self._grad(k, g)))
    def _out(self, k, o):  # returns None: the output as it is
        if o.requires_grad: o.register_hook(lambda g: self.order_.append(('out', k)))
    def before_batch(self): self.order_ = []
    def _grad(self, k, g):
        self.order_.append(('w', k)); self.dts.add(g.dtype)
    def after_batch(self):
        if self.training: self.last = self.order_
    def after_fit(self):
        for h in self.hs: h.remove()

@pytest.mark.parametrize('dtype', ['bf16', 'fp16'])
def test_each_weights_grad_comes_as_its_layers_backward_ends(dtype):
    "A layer's weight grad reaches its fp32 param before the layer below runs its backward, as in fp32"
    runs = {}
    for how in ('fp32', dtype):
        learn = Learner(synth_dls(), mlp(), loss_func=nn.MSELoss(), cbs=(b := Backward()))
        if how != 'fp32': learn.to_half(dtype, fp32_math=False, init_scale=256.)
        fit(learn)
        runs[how] = b
    half, ref = runs[dtype], runs['fp32']
    assert half.last == ref.last, (half.last, ref.last)  # w2 before out1, w1 before out0...: fp32's order
    assert [e for e in half.last if e[0] == 'w'] == [('w', 2), ('w', 1), ('w', 0)]
    assert half.dts == {torch.float32}  # into the fp32 params
    assert fp32_everywhere(learn) and not any('forward' in m.__dict__ for m in learn.model.modules())  # nothing left on the model

def test_checkpointed_blocks_cast_again_and_train_as_without():
    "A checkpointed block's recomputation in the backward makes its casts again: the same grads as without checkpointing"
    from torch.utils.checkpoint import checkpoint
    class Ck(nn.Module):
        def __init__(self, ck): super().__init__(); self.ck, self.pre, self.a, self.b = ck, nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 2)
        def forward(self, x):
            x = self.pre(x)  # the block's input requires grad (reentrant checkpointing needs it)
            h = checkpoint(lambda t: F.relu(self.a(t)), x, use_reentrant=self.ck == 'reentrant') if self.ck else F.relu(self.a(x))
            return self.b(h)
    grads = {}
    for ck in (None, 'reentrant', 'nonreentrant'):
        torch.manual_seed(0)
        learn = Learner(synth_dls(), Ck(ck), loss_func=nn.MSELoss(), cbs=(g := GradsAt()))
        fit(learn.to_half('bf16', fp32_math=False))
        grads[ck] = g.grads
    for ck in ('reentrant', 'nonreentrant'):
        assert all(torch.equal(a, b) for a, b in zip(grads[ck], grads[None])), ck  # bit for bit: the same casts, made again

class GradsAt(Callback):
    "The first training batch's grads, at `before_step`"
    order = 20
    def before_fit(self): self.grads = None
    def before_step(self):
        if self.grads is None: self.grads = [p.grad.clone() for p in self.model.parameters()]

class Clamp(Callback):
    "WGAN's weight clipping as users write it, after MixedPrecision: through `.data`, at `event`"
    order = 20
    def __init__(self, event, c=.01): self.c = c; setattr(self, event, self._clamp)
    def _clamp(self):
        if self.training:
            for p in self.model.parameters(): p.data.clamp_(-self.c, self.c)

@pytest.mark.parametrize('event', ['before_batch', 'after_pred', 'after_loss', 'before_step'])
@pytest.mark.parametrize('dtype', ['bf16', 'fp16'])
def test_a_write_through_data_lands_at_every_event(event, dtype):
    "A clamp through `.data` in flight (after MixedPrecision's `before_batch`, at `after_pred`...) holds as in fp32 (lost before)"
    top = {}
    for how in ('fp32', dtype):
        learn = Learner(synth_dls(), mlp(), loss_func=nn.MSELoss(), cbs=Clamp(event))
        if how != 'fp32': learn.to_half(dtype, init_scale=256.)
        fit(learn, 2)
        top[how] = max(p.abs().max().item() for p in learn.model.parameters())
        w = [p.detach().clone() for p in learn.model.parameters()]
    assert top[dtype] <= top['fp32'] * 1.5 + 1e-3 and top['fp32'] < .05, top  # 0.37 when the clamp was lost
    assert fp32_everywhere(learn) and learn.mixed_precision.skipped == 0

class OffHead(nn.Module):
    "A head under `autocast(enabled=False)`, fed `h.float()`, as torch.amp's docs show"
    def __init__(self): super().__init__(); self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x):
        h = F.relu(self.body(x))
        with torch.autocast(x.device.type, enabled=False): return self.head(h.float())

@pytest.mark.parametrize('masters', ['split', 'kahan', 'stochastic'])
def test_an_autocast_off_region_under_lean_masters_computes_with_the_fp32_values(masters):
    "`masters='split'`... keep bf16 params: a region computes with each param's exact fp32 master value (two dtypes before)"
    seen = []
    class Spy(Callback):
        order = 20  # after MixedPrecision's `before_fit`: the params are lean (bf16)
        def before_fit(self):
            lean = self.learn.mixed_precision.lean
            def spy(m, a, out):  # what the head computed is fp32 math on its params' exact fp32 values
                with torch.no_grad(): seen.append((m.weight.dtype, out.dtype, torch.equal(out, F.linear(a[0], lean.master(m.weight), lean.master(m.bias)))))
            self.h = self.model.head.register_forward_hook(spy)
        def after_fit(self): self.h.remove()
    ends = {}
    for how in ('fp32', masters):
        torch.manual_seed(0)
        learn = Learner(synth_dls(), OffHead(), loss_func=nn.MSELoss(), cbs=[] if how == 'fp32' else [Spy()])
        if how != 'fp32': learn.to_half('bf16', masters=masters)
        fit(learn, 2)
        ends[how] = learn.recorder.values[-1][1]
    assert seen and set(seen) == {(torch.bfloat16, torch.float32, True)}  # bf16 params, read as their exact fp32 values
    assert abs(ends[masters] / ends['fp32'] - 1) < .1, ends
    assert fp32_everywhere(learn)

class Bag(nn.Module):
    "Bags of words weighted by a mask made in the forward (fp32, as autocast leaves it), then CLIP's LayerNorm, computed in fp32"
    def __init__(self): super().__init__(); self.bag, self.ln, self.out = nn.EmbeddingBag(10, 4, mode='sum'), nn.LayerNorm(4), nn.Linear(4, 2)
    def forward(self, ids):
        w = (ids > 2).float() / ids.shape[1]
        h = self.bag(ids, per_sample_weights=w)
        self.bag_dtype = h.dtype
        return self.out(self.ln(h.float()).type_as(h))

def bag_dls():
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 10, (64, 5), generator=g), torch.randn(64, 2, generator=g)
    return DataLoaders.from_dsets(list(zip(ids[:48], y[:48])), list(zip(ids[48:], y[48:])), bs=16, device='cpu')

@pytest.mark.parametrize('how', ['bf16', 'fp16', 'split', 'autocast=False'])
def test_ops_that_need_one_dtype_compute_as_under_autocast(how):
    "`embedding_bag` with fp32 `per_sample_weights` made in the forward, a norm fed fp32: fp32 with the fp32 values, as autocast (two dtypes before); every op in half too"
    torch.manual_seed(0)
    ref = fit(Learner(bag_dls(), Bag(), loss_func=nn.MSELoss()), 3)
    with torch.autocast('cpu', torch.bfloat16): ref.model(torch.randint(0, 10, (2, 5)))
    torch.manual_seed(0)
    learn = Learner(bag_dls(), Bag(), loss_func=nn.MSELoss())
    kw = dict(masters='split') if how == 'split' else dict(autocast=False, fp32_math=False) if how == 'autocast=False' else {}
    learn.to_half('fp16' if how == 'fp16' else 'bf16', **kw)
    fit(learn, 3)
    assert learn.model.bag_dtype == ref.model.bag_dtype == torch.float32  # as under autocast: fp32
    assert abs(learn.recorder.values[-1][1] / ref.recorder.values[-1][1] - 1) < .1
    assert fp32_everywhere(learn)
