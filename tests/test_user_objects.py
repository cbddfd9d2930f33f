"""Issue 53: whatever a user does with the model, its forwards and its optimizer mid-fit meets their model, not our
machinery. Each situation against the same code in plain fp32 (or with fp32 masters), and the user's objects checked after
the fit: their forward still set, their copy independent, their optimizer's state kept. Two plans each: torch.autocast's
policy (the plan of a CPU with fast bf16, injected) and the op-by-op casts (fp32 math, the plan of a CPU without)."""
import copy, io, pickle, warnings
import torch, torch.nn as nn, torch.nn.functional as F, pytest
from fastai.learner import Learner
from fastai.optimizer import OptimWrapper, SGD
from fastai.callback.core import Callback
from fastai_fp16.all import *
from helpers import *

def mlp(): torch.manual_seed(0); return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

# (dtype, to_half's settings, the CPU class the plan is made for): autocast's policy, and the op-by-op casts
plans = {'bf16-autocast': ('bf16', {}, 'avx512_bf16'), 'bf16-ops': ('bf16', dict(fp32_math=True), 'avx2'),
         'fp16-ops': ('fp16', dict(init_scale=256.), 'avx2'), 'fp16-autocast': ('fp16', dict(fp32_math=False, init_scale=256.), 'avx512_bf16')}

def fit(learn, n=2, lr=1e-2, cls='avx2', **kw):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings(), assume_capabilities(cpu_caps(cls)):
        warnings.simplefilter('ignore')
        learn.fit(n, lr, **kw)
    return learn

def learner(model, how, cbs=(), dls=None, **kw):
    "`model` in a Learner, trained by `how`: 'fp32' or a key of `plans`; (learn, the CPU class)"
    learn = Learner(dls or synth_dls(), model, loss_func=nn.MSELoss(), cbs=list(cbs))
    if how == 'fp32': return learn, 'avx2'
    dt, st, cls = plans[how]
    learn.to_half(dt, **{**st, **kw})
    return learn, cls

def trained(model, how, cbs=(), n=2, lr=1e-2, **kw):
    learn, cls = learner(model, how, cbs, **kw)
    return fit(learn, n, lr, cls=cls)

every = pytest.mark.parametrize('how', list(plans))

class SetForward(Callback):
    "Sets `model[2].forward` once, at the first batch of the kind given (`train`/`valid`), from inside the batch (after `before_batch`)"
    order = 20
    def __init__(self, when): self.when, self.calls, self.set = when, 0, False
    def after_pred(self):
        if not self.set and self.training == (self.when == 'train'):
            lin = self.model[2]
            def f(x): self.calls += 1; return F.linear(x, lin.weight, lin.bias)
            lin.forward, self.set = f, True

@pytest.mark.parametrize('when', ['train', 'valid'])
@every
def test_a_forward_set_in_flight_stays(how, when):
    "1. `model.head.forward = f` from a callback during a batch (training or validation) runs at every later batch, as in fp32"
    calls = {}
    for h in ('fp32', how):
        learn = trained(mlp(), h, [s := SetForward(when)])
        calls[h] = s.calls
        assert 'forward' in learn.model[2].__dict__  # still the user's
    assert calls[how] == calls['fp32'] > 2, calls

class Lazy(nn.Module):
    "A model that picks its head's forward in its own first forward (a lazy dispatch)"
    def __init__(self): super().__init__(); self.body, self.head, self.calls = nn.Linear(4, 8), nn.Linear(8, 2), 0
    def forward(self, x):
        if 'forward' not in self.head.__dict__:
            def f(h): self.calls += 1; return F.linear(h, self.head.weight, self.head.bias)
            self.head.forward = f
        return self.head(F.relu(self.body(x)))

@every
def test_a_forward_the_model_sets_in_its_forward_stays(how):
    calls = {}
    for h in ('fp32', how):
        torch.manual_seed(0); learn = trained(Lazy(), h)
        calls[h] = learn.model.calls
    assert calls[how] == calls['fp32'] > 2, calls

class Snapshot(Callback):
    "Copies, pickles and saves the model during validation, while its forward computes in half (`after_pred`, order 0)"
    def before_fit(self): self.copy = self.sd = None
    def after_pred(self):
        if self.training or self.copy is not None: return
        m = self.learn.model
        self.copy, self.blob, self.sd = copy.deepcopy(m), pickle.dumps(m), {k: v.clone() for k,v in m.state_dict().items()}
        b = io.BytesIO(); torch.save(m, b); self.saved = b.getvalue()

@every
def test_a_copy_or_pickle_during_validation_is_the_users_model_at_rest(how):
    "2. Deep-copied, pickled or saved mid-validation, the model is a plain fp32 copy that runs on its own weights, during the fit and after"
    learn = trained(mlp(), how, [s := Snapshot()])
    x = torch.randn(3, 4)
    c, p = s.copy, pickle.loads(s.blob)
    t = torch.load(io.BytesIO(s.saved), weights_only=False)
    ref = mlp(); ref.load_state_dict(s.sd)
    with torch.no_grad():
        for m in (c, p, t):
            assert {q.dtype for q in m.parameters()} == {torch.float32}
            assert not any(mm._forward_pre_hooks or mm._forward_hooks or 'forward' in mm.__dict__ for mm in m.modules())
            assert torch.equal(m(x), ref(x))  # its own weights, the model's at the copy, in fp32
        assert not torch.equal(c[0].weight, learn.model[0].weight)  # the fit went on without it
    assert {v.dtype for v in s.sd.values()} == {torch.float32}  # a state dict mid-validation: fp32, buffers too

class ScriptNet(nn.Module):
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(4, 8), torch.jit.script(nn.Linear(8, 2))
    def forward(self, x): return self.b(F.relu(self.a(x)))

@pytest.mark.parametrize('how', ['fp32', 'bf16-autocast', 'bf16-ops', 'fp16-ops'])
def test_a_scripted_submodule_trains_as_under_autocast(how):
    "3. A `torch.jit.script`ed part trains (torch.autocast's casts reach its ops), its params moving as in fp32"
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch.jit's deprecation
        torch.manual_seed(0); m = ScriptNet(); w0 = [p.detach().clone() for p in m.parameters()]
        torch.manual_seed(0); ref = trained(ScriptNet(), 'fp32', n=3)  # (a deep copy of a scripted module does not train)
        learn = trained(m, how, n=3)
    moved_alike(params(learn), params(ref), w0, tol=0.25)
    assert fp32_everywhere(learn)

def test_a_scripted_submodule_without_autocast_is_refused_by_name():
    "Every op in half (`autocast=False`) casts op by op, which a scripted part's ops never meet: refused, naming it and the fix"
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn, cls = learner(ScriptNet(), 'bf16-ops', autocast=False)
        with pytest.raises(ValueError, match=r"'b' is a TorchScript module.*autocast=True.*keep_fp32=\['b'\]"): fit(learn, 1, cls=cls)
    assert fp32_everywhere(learn)
    learn, cls = learner(ScriptNet(), 'bf16-ops', autocast=False, keep_fp32=['b'])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); fit(learn, 1, cls=cls)
    assert fp32_everywhere(learn)

def clamped(how, when):
    "WGAN's weight clipping through `.data` in a forward pre-hook, put on before the fit or mid-fit"
    m = mlp()
    class Later(Callback):
        order = 20
        def after_batch(self):
            if when == 'mid' and not m[0]._forward_pre_hooks: m[0].register_forward_pre_hook(clip)
    def clip(mod, args): mod.weight.data.clamp_(-.1, .1)  # returns None: the input as it is
    if when == 'before': m[0].register_forward_pre_hook(clip)
    return trained(m, how, [Later()], n=2, lr=3e-2).model[0].weight.abs().max().item()

@pytest.mark.parametrize('when', ['before', 'mid'])
@every
def test_a_write_through_data_in_a_pre_hook_lands(how, when):
    "4. `m.weight.data.clamp_` in a forward pre-hook holds as in fp32 (0.345 where fp32 ends at 0.100 before)"
    top, ref = clamped(how, when), clamped('fp32', when)
    assert abs(top - ref) < 1e-3 and ref <= .1 + 1e-6, (top, ref)

# --- lean masters

class NewOpt(Callback):
    "Makes a new optimizer at the second training batch: fastai's `create_opt`, or an assignment of a torch SGD with momentum"
    order = 20
    def __init__(self, how): self.how, self.n, self.opt_made = how, 0, None
    def after_batch(self):
        if not self.training: return
        self.n += 1
        if self.n != 2: return
        if self.how == 'create_opt': self.learn.create_opt()
        else: self.learn.opt = OptimWrapper(list(self.model.parameters()), torch.optim.SGD, lr=1e-2, momentum=.9)
        self.opt_made = self.learn.opt

@pytest.mark.parametrize('masters', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('make', ['create_opt', 'assign'])
def test_an_optimizer_made_mid_fit_keeps_its_state(make, masters):
    "5. An optimizer made mid-fit keeps its state (Adam's averages, SGD's momentum) under lean masters, as under fp32 masters"
    ends = {}
    for ms in ('fp32', masters):
        torch.manual_seed(0)
        learn, cls = learner(mlp(), 'bf16-autocast', [s := NewOpt(make)], masters=ms)
        fit(learn, 2, cls=cls)
        st = s.opt_made.state_dict()['state']
        states = st.values() if isinstance(st, dict) else st
        keys = {k for v in states for k in v}  # (fastai's `create_opt` puts `do_wd` in some params' states itself)
        assert learn.opt is s.opt_made and keys & {'grad_avg', 'sqr_avg', 'momentum_buffer'}, (ms, keys)  # its averages kept
        ends[ms] = params(learn)
    tol = 1e-3 if masters == 'split' else 5e-3  # split steps exactly as fp32 masters: only the grads differ, by bf16's roundings
    assert all((a - b).abs().max() < tol for a, b in zip(ends[masters], ends['fp32'])), [float((a - b).abs().max()) for a, b in zip(ends[masters], ends['fp32'])]

def body_head_learner(masters, cbs):
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2))
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), cbs=cbs, splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
    return learn.to_half('bf16', masters=masters)

class ThawMidFit(Callback):
    order = 20
    def after_epoch(self):
        if self.epoch == 0: self.learn.unfreeze()

@pytest.mark.parametrize('masters', ['split', 'kahan', 'stochastic'])
def test_unfreezing_mid_fit_keeps_the_masters(masters):
    "6. `learn.unfreeze()` mid-fit (fastai's `freeze_to` wipes the optimizer's state) trains on, as with fp32 masters"
    ends = {}
    for ms in ('fp32', masters):
        torch.manual_seed(0)
        learn = body_head_learner(ms, [ThawMidFit()])
        learn.freeze()
        fit(learn, 3, cls='avx512_bf16')
        ends[ms] = params(learn)
        assert fp32_everywhere(learn)
    assert all((a - b).abs().max() < 5e-3 for a, b in zip(ends[masters], ends['fp32']))

class Fails(Callback):
    "Records the masters after each step, and raises at the forward of the fourth training batch"
    order = 20
    def before_fit(self): self.n, self.last = 0, None
    def after_step(self): self.last = [self.learn.mixed_precision.master(p).detach().clone() for p in self.model.parameters()]
    def before_batch(self):
        if self.training:
            self.n += 1
            if self.n == 4: self.learn.opt.clear_state(); raise RuntimeError('the data broke')

@pytest.mark.parametrize('masters', ['split', 'kahan'])
def test_a_fit_that_raises_leaves_each_params_fp32_value(masters):
    "A fit that raises after its optimizer's state was cleared leaves each param's fp32 value as the last step made it"
    learn = body_head_learner(masters, [f := Fails()])
    with pytest.raises(RuntimeError, match='the data broke'): fit(learn, 3, cls='avx512_bf16')
    assert fp32_everywhere(learn)
    assert all(torch.equal(a, b) for a, b in zip(params(learn), f.last))

class EMA(Callback):
    "An EMA as timm's (and fastxtend's) makes it: a deep copy at `before_fit`, ordered after ours, updated from `model.state_dict()`"
    order = 11
    def before_fit(self): self.ema = copy.deepcopy(self.learn.model)
    def after_batch(self):
        if not self.training: return
        with torch.no_grad():
            for e, m in zip(self.ema.state_dict().values(), self.learn.model.state_dict().values()): e.copy_(.9 * e + .1 * m)

@pytest.mark.parametrize('masters', ['split', 'kahan', 'stochastic'])
def test_a_users_ema_made_at_before_fit_is_fp32(masters):
    "7. A user's EMA deep-copied after our `before_fit` is fp32 and averages the fp32 values, as with fp32 masters; it runs after the fit"
    emas = {}
    for ms in ('fp32', masters):
        torch.manual_seed(0)
        learn, cls = learner(mlp(), 'bf16-autocast', [e := EMA()], masters=ms)
        fit(learn, 2, cls=cls)
        assert {p.dtype for p in e.ema.parameters()} == {torch.float32}
        assert e.ema(torch.randn(2, 4)).dtype == torch.float32  # after the fit: a plain fp32 model
        emas[ms] = list(e.ema.parameters())
    assert all((a - b).abs().max() < 5e-3 for a, b in zip(emas[masters], emas['fp32']))

class Reinit(Callback):
    "Re-initializes the head mid-fit with `nn.init.orthogonal_` (QR: no bf16 kernel on a CPU)"
    order = 20
    def after_epoch(self):
        if self.epoch == 0:
            nn.init.orthogonal_(self.model[4].weight)
            w = self.learn.mixed_precision.master(self.model[4].weight)
            self.gram = w @ w.T

def test_init_functions_work_on_a_lean_param():
    "8. `nn.init.orthogonal_` on a lean param mid-fit computes in fp32 and lands as a write"
    learn, cls = learner(mlp(), 'bf16-autocast', [r := Reinit()], masters='split')
    fit(learn, 2, cls=cls)
    assert torch.allclose(r.gram, torch.eye(2), atol=1e-2)  # orthogonal rows, to bf16's rounding
    assert fp32_everywhere(learn)

class SVD(Callback):
    order = 20
    def after_epoch(self):
        w = self.model[0].weight
        with torch.no_grad(): self.got, self.exact = torch.linalg.svdvals(w), torch.linalg.svdvals(self.learn.mixed_precision.master(w))

def test_an_op_without_a_bf16_kernel_on_a_lean_param_reads_its_fp32_value():
    "An op with no bf16 kernel (an SVD), called on a lean param at rest, computes as on fp32 masters: on its exact fp32 value"
    learn, cls = learner(mlp(), 'bf16-autocast', [s := SVD()], masters='split')
    fit(learn, 1, cls=cls)
    assert s.got.dtype == torch.float32 and torch.equal(s.got, s.exact)
    assert fp32_everywhere(learn)

class Reload(Callback):
    "A state dict taken at the end of epoch 0 and loaded back at the end of epoch 1, through `load_state_dict` or `p.data = t`"
    order = 20
    def __init__(self, how): self.how = how
    def after_epoch(self):
        m = self.learn.model
        if self.epoch == 0: self.sd = m.state_dict(); self.sd = {k: v.clone() for k,v in self.sd.items()}
        if self.epoch == 1:
            if self.how == 'load_state_dict': m.load_state_dict(self.sd)
            else:
                for n,p in m.named_parameters(): p.data = self.sd[n].clone()
            self.back = [self.learn.mixed_precision.master(p).detach().clone() for p in m.parameters()]

@pytest.mark.parametrize('masters', ['split', 'kahan', 'stochastic'])
@pytest.mark.parametrize('how', ['load_state_dict', 'data'])
def test_a_state_dict_mid_fit_holds_and_loads_the_fp32_values(how, masters):
    "10. A `state_dict()` mid-fit holds each param's exact fp32 value; `load_state_dict` and `p.data = t` load them back alike, exactly"
    learn, cls = learner(mlp(), 'bf16-autocast', [r := Reload(how)], masters=masters)
    fit(learn, 2, cls=cls)
    assert {v.dtype for v in r.sd.values()} == {torch.float32}
    assert all(torch.equal(a, r.sd[n]) for a, (n, _) in zip(r.back, learn.model.named_parameters())), how

def test_compiled_model_makes_no_more_graphs_than_fp32():
    "9. `model.compile()` (torch's in-place form) makes as many graphs as in fp32: nothing changes between batches"
    counts = {}
    for how in ('fp32', 'bf16-autocast', 'fp16-autocast'):
        graphs = []
        def backend(gm, inputs): graphs.append(gm); return gm.forward
        torch._dynamo.reset()
        m = mlp(); m.compile(backend=backend)
        learn = trained(m, how, n=2)
        counts[how] = len(graphs)
        assert fp32_everywhere(learn)
    torch._dynamo.reset()
    assert counts['bf16-autocast'] <= counts['fp32'] and counts['fp16-autocast'] <= counts['fp32'], counts
