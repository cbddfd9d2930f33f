"""Model code users write themselves, which torch.autocast trains: under `to_half` each trains as in fp32 (issue 40).
Each model is trained three ways on the same data from the same start: plain fp32, torch.autocast (what fastai's `to_fp16`
runs, here on a CPU) and `to_half`; the params must move as fp32's do. The plan is injected (native bf16 kernels, no fp32
math), so that what runs is the same on every CPU class, and a GPU's: fp16 and bf16 layers compute in half."""
import copy, math, warnings, torch, torch.nn as nn, torch.nn.functional as F, pytest
from torch.utils._python_dispatch import TorchDispatchMode
from fastai.learner import Learner
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai_fp16.all import *
from helpers import *

class Autocast(Callback):
    "torch.autocast from `before_batch` to `after_loss`, predictions cast to fp32: fastai's `to_fp16` without its GPU-only parts"
    order = 10
    def __init__(self, dtype): self.dtype, self.ac = dtype, None
    def before_batch(self): self.ac = torch.autocast('cpu', dtype=self.dtype); self.ac.__enter__()
    def after_pred(self): self.learn.pred = self.pred.float()
    def after_loss(self): self._exit()
    def after_cancel_batch(self): self._exit()
    def _exit(self):
        if self.ac is not None: self.ac.__exit__(None, None, None); self.ac = None

def fit(model, how, cbs=(), epochs=2, lr=1e-2, **kw):
    "`model` trained by `how`: 'fp32', 'autocast_bf16'/'autocast_fp16', or `to_half(how)` (a static scale: no skipped step)"
    learn = Learner(synth_dls(n=64, bs=16), model, loss_func=nn.MSELoss(), opt_func=SGD, cbs=list(cbs))
    if how.startswith('autocast'): learn.add_cb(Autocast(torch.bfloat16 if how.endswith('bf16') else torch.float16))
    elif how != 'fp32': learn.to_half(how, fp32_math=False, init_scale=256. if how == 'fp16' else 1., dynamic=False, **kw)
    with warnings.catch_warnings(), assume_capabilities(cpu_caps('avx512_bf16')), learn.no_bar(), learn.no_logging():
        warnings.simplefilter('ignore')  # fp16 kernels are slow on a CPU: said once
        learn.fit(epochs, lr)
    return learn

def trains_as_fp32(make, dtype, cbs=lambda: (), ours_cbs=None, **kw):
    "`make()`'s model trained under autocast and under `to_half(dtype)` moves as in fp32; the half Learner"
    torch.manual_seed(0); m = make(); w0 = [p.detach().clone() for p in m.parameters()]
    ref = fit(copy.deepcopy(m), 'fp32', cbs())
    auto = fit(copy.deepcopy(m), f'autocast_{dtype}', cbs())
    ours = fit(m, dtype, (ours_cbs or cbs)(), **kw)
    moved_alike(params(auto), params(ref), w0, tol=0.25)  # the code is one autocast trains
    moved_alike(params(ours), params(ref), w0, tol=0.25)
    assert fp32_everywhere(ours) and math.isfinite(ours.recorder.values[-1][0])
    return ours

dtypes = pytest.mark.parametrize('dtype', ['bf16', 'fp16'])

def sinusoidal(t, d):
    "A timestep's (or position's) sinusoidal embedding, made in the forward from integers: fp32"
    f = torch.exp(-math.log(1e4) * torch.arange(d // 2, device=t.device) / (d // 2))
    a = t[:, None].float() * f[None]
    return torch.cat([a.sin(), a.cos()], -1)

class TimestepEmbed(nn.Module):
    "A diffusion model's conditioning: an MLP on the sinusoidal embedding of a timestep"
    def __init__(self): super().__init__(); self.inp, self.t, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
    def forward(self, x):
        t = torch.arange(x.shape[0], device=x.device) % 10
        return self.out(F.relu(self.inp(x) + self.t(sinusoidal(t, 8))))

class Attention(nn.Module):
    "A transformer block: positional encoding and a float causal mask made in the forward"
    def __init__(self): super().__init__(); self.emb, self.att, self.out = nn.Linear(1, 8), nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)
    def forward(self, x):
        h = self.emb(x[..., None])  # the 4 features as a sequence
        T = h.shape[1]
        h = h + sinusoidal(torch.arange(T, device=x.device), 8)[None]
        mask = torch.triu(torch.full((T, T), float('-inf'), device=x.device), 1)
        h, _ = self.att(h, h, h, attn_mask=mask, need_weights=False)
        return self.out(h.mean(1))

class FloatHead(nn.Module):
    "A head fed `h.float()`"
    def __init__(self): super().__init__(); self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x): return self.head(F.relu(self.body(x)).float())

@dtypes
@pytest.mark.parametrize('make', [TimestepEmbed, Attention, FloatHead])
def test_tensors_made_in_the_forward(make, dtype):
    trains_as_fp32(make, dtype)  # "mat1 and mat2 must have the same dtype" before (fp16 too, without fp32 math)

class STFT(nn.Module):
    "An audio front-end: the magnitude of a short-time Fourier transform"
    def __init__(self): super().__init__(); self.pre, self.out = nn.Linear(4, 16), nn.Linear(25, 2)
    def forward(self, x):
        z = torch.stft(self.pre(x), n_fft=8, hop_length=4, window=torch.hann_window(8, device=x.device), return_complex=True)
        return self.out(z.abs().flatten(1))

class FFTLayer(nn.Module):
    "A spectral mixing layer (FNet style)"
    def __init__(self): super().__init__(); self.pre, self.out = nn.Linear(4, 16), nn.Linear(9, 2)
    def forward(self, x): return self.out(torch.fft.rfft(self.pre(x), dim=-1).abs())

class Prototypes(nn.Module):
    "Metric learning: logits are minus the distances to learned prototypes"
    def __init__(self): super().__init__(); self.pre, self.protos = nn.Linear(4, 8), nn.Parameter(torch.randn(2, 8))
    def forward(self, x): return -torch.cdist(self.pre(x), self.protos)

@dtypes
@pytest.mark.parametrize('make', [STFT, FFTLayer, Prototypes])
def test_ops_without_half_kernels(make, dtype):
    trains_as_fp32(make, dtype)  # "MKL FFT doesn't support", "cdist not implemented for 'Half'" before: autocast runs them fp32

class SpectralConv(nn.Module):
    "A neural operator's Fourier layer: complex weights on the lowest modes"
    def __init__(self):
        super().__init__(); self.pre, self.out = nn.Linear(4, 16), nn.Linear(16, 2)
        self.w = nn.Parameter(torch.randn(5, dtype=torch.cfloat) * 0.5)
    def forward(self, x):
        f = torch.fft.rfft(self.pre(x), dim=-1)
        f = torch.cat([f[..., :5] * self.w, torch.zeros_like(f[..., 5:])], -1)
        return self.out(torch.fft.irfft(f, n=16, dim=-1))

@dtypes
@pytest.mark.parametrize('clip', [None, 1.])
def test_complex_params(dtype, clip):
    from fastai.callback.training import GradientClip
    cbs = lambda: [] if clip is None else [GradientClip(clip)]  # fp32 and autocast clip with fastai's callback, ours with `clip`
    learn = trains_as_fp32(SpectralConv, dtype, cbs, lambda: [], **({} if clip is None else dict(clip=clip)))  # NotImplementedError before
    assert learn.model.w.dtype == torch.cfloat and not learn.mixed_precision.skipped

def test_complex_grads_unscaled_and_checked():
    g, inv, fi = torch.full((3,), 4+8j), torch.full((1,), .25), torch.zeros(1)
    unscale_grads_([g, torch.full((2,), 4.)], inv, fi)
    assert torch.equal(g, torch.full((3,), 1+2j)) and fi.item() == 0
    unscale_grads_([torch.tensor([complex(1, math.inf)])], inv, fi)
    assert fi.item() == 1  # an inf in the imaginary part is found

class OffHead(nn.Module):
    "A head kept fp32 as torch.amp's docs show: autocast off around it, fed `h.float()`"
    def __init__(self): super().__init__(); self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x):
        h = F.relu(self.body(x))
        with torch.autocast(x.device.type, enabled=False):
            self.seen = (self.head.weight.dtype, self.body.weight.dtype, torch.is_autocast_enabled(x.device.type))
            return self.head(h.float())

class Spy(Callback):
    order = 20
    def before_fit(self): self.h = self.model.body.register_forward_hook(lambda m, a, o: setattr(self, 'body', o.dtype))
    def after_pred(self):
        if self.training: self.seen = (self.model.seen, self.pred.dtype, self.body)
    def after_fit(self): self.h.remove()

@dtypes
def test_autocast_off_in_the_model_computes_fp32(dtype):
    spy = Spy()
    trains_as_fp32(OffHead, dtype, cbs=lambda: [spy])  # the raw two-dtypes error before
    half = torch.bfloat16 if dtype == 'bf16' else torch.float16
    # inside the region: the head's fp32 params (all of the model's), autocast off; the body computed in half
    assert spy.seen == ((torch.float32, torch.float32, False), torch.float32, half), spy.seen

class SAM(Callback):
    "Sharpness-aware minimization's second forward and backward as users write it: in `before_step`, at rest, the batch as float"
    order = 5  # before MixedPrecision's `before_step`
    def before_step(self):
        ps = [p for p in self.model.parameters() if p.grad is not None]
        with torch.no_grad():
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))
            es = [.05 * p.grad / (n + 1e-12) for p in ps]  # the ascent: its direction, whatever the scale of the grads
            for p, e in zip(ps, es): p.add_(e)
        self.opt.zero_grad()
        self.loss_func(self.model(*[x.float() for x in self.xb]), *self.yb).backward()  # at rest: fp32, not scaled
        with torch.no_grad():
            for p, e in zip(ps, es): p.sub_(e)

@dtypes
def test_second_forward_and_backward_at_rest(dtype):
    ours = trains_as_fp32(lambda: tiny_model(bn=False), dtype, cbs=lambda: [SAM()])  # fp16: the weights moved 1/256 of fp32's before
    assert not ours.mixed_precision.skipped

class Accumulating(SAM):
    "A forward and backward at rest between the micro-batches of gradient accumulation: its grads added to the step's"
    def before_step(self): pass
    def after_backward(self):
        if self.training: self.loss_func(self.model(*[x.float() for x in self.xb]), *self.yb).backward()

def test_forward_at_rest_between_micro_batches():
    from fastai.callback.training import GradientAccumulation
    trains_as_fp32(lambda: tiny_model(bn=False), 'fp16', cbs=lambda: [Accumulating(), GradientAccumulation(32)])

class SpectralNormed(nn.Module):
    "A GAN critic's layers as many still write them: old-style `spectral_norm`"
    def __init__(self): super().__init__(); self.a, self.b = nn.utils.spectral_norm(nn.Linear(4, 8)), nn.Linear(8, 2)
    def forward(self, x): return self.b(F.relu(self.a(x)))

@dtypes
def test_spectral_norm_weight_is_fp32_at_rest(dtype):
    learn = trains_as_fp32(SpectralNormed, dtype)
    a = learn.model.a
    sigma = torch.dot(a.weight_u, a.weight_orig @ a.weight_v)
    assert a.weight.dtype == torch.float32 and torch.allclose(a.weight, a.weight_orig / sigma)  # bf16/fp16 before
    assert {a.weight_u.dtype, a.weight_v.dtype} == {torch.float32}

class FloatAndPlace(Callback):
    "A user's callback making sure the model is fp32 on the CPU: a no-op in fp32, and in flight"
    def __init__(self, order): self.order, self.calls = order, 0
    def before_batch(self): self.learn.model.float(); self.learn.model.to('cpu'); self.calls += 1

@pytest.mark.parametrize('order', [0, 20])  # before the window opens at training batches (open at validation), and after
def test_model_float_from_a_callback(order):
    cb = FloatAndPlace(order)
    trains_as_fp32(tiny_model, 'bf16', cbs=lambda: [FloatAndPlace(order)], ours_cbs=lambda: [cb])  # the two-dtypes error before
    assert cb.calls == 2 * (3 + 1)  # every batch of both epochs (3 training, 1 validation)

class LazyNet(nn.Module):
    def __init__(self): super().__init__(); self.a, self.b = nn.LazyLinear(8), nn.Linear(8, 2)
    def forward(self, x): return self.b(F.relu(self.a(x)))

class LazySpy(Callback):
    "The dtype the lazy layer computes in at each training batch; every param as the first forward made it"
    order = 20
    def before_fit(self):
        self.seen, self.w0 = [], None
        self.h = self.model.a.register_forward_hook(lambda m, a, o: setattr(self, 'a', o.dtype))
    def after_pred(self):
        if not self.training: return
        self.seen.append(self.a)  # as the lazy layer computed: read inside its forward
        if self.w0 is None: self.w0 = [p.detach().float().clone() for p in self.model.parameters()]
    def after_fit(self): self.h.remove()

@dtypes
def test_lazy_module(dtype):
    spy, ref_spy = LazySpy(), LazySpy()
    torch.manual_seed(0); m = LazyNet(); ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch: lazy modules are a new feature
        torch.manual_seed(1); a = fit(ref, 'fp32', [ref_spy])  # the params are made at the first forward, from the same random state
        torch.manual_seed(1); b = fit(m, dtype, [spy])  # "in_features inferred from input: 4 is not equal to ... 0" before
    half = torch.bfloat16 if dtype == 'bf16' else torch.float16
    assert spy.seen == [half] * 6  # made fp32 at its first forward, computing in half from then on, as under autocast
    assert torch.equal(spy.w0[0], ref_spy.w0[0])  # the same start
    moved_alike(params(b), params(a), ref_spy.w0, tol=0.25)
    assert type(m.a) is nn.Linear and fp32_everywhere(b)

class Ops(TorchDispatchMode):
    "The dtypes each matmul and convolution gets, as the dispatcher sees them"
    def __init__(self): super().__init__(); self.seen = set()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.convolution):
            self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))

def test_fp32_math_and_kept_modules_compute_fp32_under_autocast():
    "What the plan keeps fp32 is not lowered again: fp32 math (a CPU's fp16) and `keep_fp32` modules"
    m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(16, 2)).half()
    patch_fp32_math(m)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float16, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.float16), Ops() as ops: m(x).float().sum().backward()
    assert ops.seen == {torch.float32}, ops.seen  # fp16 kernels (100x slower on a CPU) without the guard
    from fastai_fp16.half_ops import KeptFp32
    lin = nn.Linear(2, 2)
    kept = KeptFp32('cpu'); kept.find([lin]); kept.on = True
    try:
        with torch.autocast('cpu', dtype=torch.bfloat16), Ops() as ops: out = lin(torch.randn(3, 2, dtype=torch.bfloat16))
    finally: kept.remove()
    assert ops.seen == {torch.float32} and out.dtype == torch.float32  # fp32 inside, and out, as an autocast-off region

class MidFitHook(Callback):
    "A forward hook put on layer `i` after the first batch, and what it saw"
    order = 20
    def __init__(self, i): self.i = i
    def before_fit(self): self.seen, self.h = [], None
    def after_batch(self):
        if self.h is None: self.h = self.model[self.i].register_forward_hook(lambda m, a, o: self.seen.append(o.dtype))
    def after_fit(self): self.h.remove()

def test_kept_modules_run_fp32_with_nothing_in_the_model(monkeypatch):
    "A `keep_fp32` module runs in fp32 through torch's global hooks: none is put on the model, a hook added mid-fit sees its fp32 output, as in fp32"
    regs, orig = [], nn.Module.register_forward_pre_hook
    monkeypatch.setattr(nn.Module, 'register_forward_pre_hook', lambda self, *a, **k: regs.append(self) or orig(self, *a, **k))
    m, spy, ref_spy = tiny_model(), MidFitHook(3), MidFitHook(3)
    ref = fit(copy.deepcopy(m), 'fp32', [ref_spy])
    learn = fit(m, 'bf16', [spy], keep_fp32=['3'])
    assert not regs  # no hook on any module of the model
    assert len(spy.seen) == len(ref_spy.seen) and set(spy.seen) == {torch.float32}  # the layer's own output, as in fp32
    assert not m[3]._forward_pre_hooks and not m[3]._forward_hooks  # none left after the fit
    assert m[3](torch.randn(3, 8)).dtype == torch.float32 and learn.model is m

class Recorded(FFTLayer):
    "An FFT layer that records whether autocast is on in its forward"
    def forward(self, x): self.on = torch.is_autocast_enabled('cpu'); return super().forward(x)

class Policy(Callback):
    order = 20
    def before_fit(self): self.seen = set()
    def after_pred(self): self.seen.add((self.model.on, torch.is_autocast_enabled('cpu')))

@pytest.mark.parametrize('autocast', [True, False])
def test_autocast_is_on_for_the_forward_only(autocast):
    "The op policy covers the model's forward, not the loss (fp32 with `loss_fp32`); `autocast=False` is every op in half, as `model.half()`"
    spy = Policy()
    learn = Learner(synth_dls(), Recorded(), loss_func=nn.MSELoss(), cbs=[spy]).to_half('bf16', autocast=autocast)
    with assume_capabilities(cpu_caps('avx512_bf16')), learn.no_bar(), learn.no_logging():
        if not autocast:
            with pytest.raises(NotImplementedError): learn.fit(1)  # FFT has no bf16 kernel on a CPU
            return
        learn.fit(1)
        preds = learn.get_preds()[0]
    assert spy.seen == {(True, False)} and not torch.is_autocast_enabled('cpu')  # on in the forward (validation too), off after
    assert preds.dtype == torch.float32  # predictions fp32, as before

def test_a_whole_model_kept_fp32_under_autocast():
    "`keep_fp32=['']`: autocast off inside the model, on around it, and off after the fit as before it"
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', keep_fp32=[''])
    with assume_capabilities(cpu_caps('avx512_bf16')), learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert not torch.is_autocast_enabled('cpu') and fp32_everywhere(learn)

def test_autocast_argument_checked():
    with pytest.raises(ValueError, match='autocast is True'): Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', autocast='yes')
