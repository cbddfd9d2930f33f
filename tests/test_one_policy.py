"""One policy on every path (issue 61): in every plan, what an op computes in is what torch.autocast decides for the device
(its lists and promotion, the user's own regions, per thread), and a plan changes only how the ops autocast lowers run (fp32
math) and, under lean masters, which tensor holds a param's value. Each test runs the same code under plain torch.autocast
(or plain fp32) and under each plan: fp32 math in fp16 and bf16, `autocast=False` where it applies, split, kahan and
stochastic. The plans are asked for explicitly (`fp32_math=True/False`), so that what runs is the same on every CPU class."""
import copy, math, threading, traceback, warnings, torch, torch.nn as nn, torch.nn.functional as F, pytest
from torch.utils.checkpoint import checkpoint
from fastai.learner import Learner
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai_fp16.all import *
from helpers import *

plans = {'fp16': dict(dtype='fp16', fp32_math=True), 'bf16': dict(dtype='bf16', fp32_math=True),
         'split': dict(dtype='bf16', masters='split', fp32_math=False), 'kahan': dict(dtype='bf16', masters='kahan', fp32_math=False),
         'stochastic': dict(dtype='bf16', masters='stochastic', fp32_math=False),
         'split_fp32_math': dict(dtype='bf16', masters='split', fp32_math=True)}
lean_plans = ['split', 'kahan', 'stochastic', 'split_fp32_math']
_dt = dict(fp16=torch.float16, bf16=torch.bfloat16)

def fit(model, plan, epochs=1, lr=1e-2, cbs=(), loss_func=None, dls=None, **kw):
    "`model` trained by `plan` (a key of `plans`, 'autocast=False', or 'fp32'), a static scale: no step skipped by design"
    learn = Learner(dls or synth_dls(n=64, bs=16), model, loss_func=loss_func or nn.MSELoss(), opt_func=SGD, cbs=list(cbs))
    if plan == 'autocast=False': learn.to_half('fp16', fp32_math=True, autocast=False, init_scale=64., dynamic=False, **kw)
    elif plan != 'fp32':
        p = dict(plans[plan]); dt = p.pop('dtype')
        learn.to_half(dt, init_scale=64. if dt == 'fp16' else 1., dynamic=False, **p, **kw)
    with warnings.catch_warnings(), assume_capabilities(cpu_caps('avx2')), learn.no_bar(), learn.no_logging():
        warnings.simplefilter('ignore')  # half kernels are slow on a CPU: said once
        learn.fit(epochs, lr)
    return learn

def plan_dtype(plan): return torch.float16 if plan in ('fp16', 'autocast=False') else torch.bfloat16

class Probe(nn.Module):
    "User code that meets autocast's policy: a param times a layer's output, ops on a param alone (a regularizer that overflows fp16), a region of the other half dtype, an fp32 region, an embedding, a norm"
    def __init__(self):
        super().__init__()
        self.lin, self.head, self.emb, self.ln = nn.Linear(4, 8), nn.Linear(8, 2), nn.Embedding(10, 8), nn.LayerNorm(8)
        self.side, self.side32 = nn.Linear(8, 2), nn.Linear(8, 2)  # autocast's cast cache keeps one dtype a weight: one layer a region
        self.gamma, self.proto = nn.Parameter(torch.ones(8)), nn.Parameter(torch.full((512, 256), 1.))
        self.seen, self.other = [], torch.bfloat16
    def forward(self, x):
        h = self.gamma * self.lin(x)
        reg = self.proto.pow(2).sum()  # 131072: inf in fp16
        with torch.autocast('cpu', dtype=self.other): hb = self.side(h)
        with torch.autocast('cpu', enabled=False): hf = self.side32(h.float())
        e, n = self.emb(torch.arange(x.shape[0]) % 10), self.ln(h)
        self.seen.append(dict(h=h.dtype, reg=reg.dtype, hb=hb.dtype, hf=hf.dtype, e=e.dtype, n=n.dtype, reg_value=reg.item(),
                              e_value=e.detach().double()))
        return self.head(n + e.to(n.dtype)) + 1e-7 * reg + 0 * (hb.float() + hf).sum()

def under_autocast(m, dt, x):
    "What `m`'s forward records under plain torch.autocast in `dt` (fp32 params), with grads, as in a training batch"
    m.seen = []
    with torch.autocast('cpu', dtype=dt): m(x)
    return m.seen[0]

@pytest.mark.parametrize('plan', list(plans))
def test_every_op_computes_in_what_autocast_decides(plan):
    "Items 2, 3, 7: a param's ops alone fp32 (no overflow), a user's region of the other dtype its own, embeddings fp32 with the fp32 values; as under autocast"
    torch.manual_seed(0); m = Probe()
    dt = plan_dtype(plan); m.other = torch.bfloat16 if dt == torch.float16 else torch.float16
    ref = under_autocast(copy.deepcopy(m), dt, torch.randn(16, 4))
    start = under_autocast(copy.deepcopy(m), dt, next(iter(synth_dls(n=64, bs=16).train))[0])
    learn = fit(m, plan)
    got = m.seen[0]  # the first training batch's forward
    keys = ('h', 'reg', 'hb', 'hf', 'e', 'n')
    assert {k: got[k] for k in keys} == {k: ref[k] for k in keys}, plan
    assert ref['reg'] == torch.float32 and ref['hb'] == m.other and ref['e'] == torch.float32
    assert learn.mixed_precision.skipped == 0 and all(math.isfinite(v) for v in learn.recorder.values[-1][:2])  # no overflow
    if plan in ('split', 'split_fp32_math', 'fp16', 'bf16'):  # the ops autocast leaves fp32 read the exact fp32 values
        assert got['reg_value'] == start['reg_value'] and torch.equal(got['e_value'], start['e_value'])
    assert fp32_everywhere(learn)

def sn_model(): return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 8)), nn.ReLU(),
                                     nn.utils.parametrizations.spectral_norm(nn.Linear(8, 2)))

@pytest.mark.parametrize('plan', ['fp16', 'bf16', 'split'])
def test_spectral_norm_trains_in_every_plan(plan):
    "Item 1: spectral norm (old and new API) trained in half as in fp32; its power iteration computes as under autocast"
    torch.manual_seed(0); m = sn_model(); w0 = [p.detach().clone() for p in m.parameters()]
    ref = fit(copy.deepcopy(m), 'fp32', epochs=2)
    learn = fit(m, plan, epochs=2)
    assert all(math.isfinite(v) for v in learn.recorder.values[-1][:2])
    moved_alike(params(learn), params(ref), w0, tol=0.25)

def test_fastais_gan_critic_trains_in_fp16():
    "Item 1: fastai's own `gan_critic` (spectral norm in every conv) in fp16 with fp32 math"
    from fastai.vision.gan import gan_critic
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 16, 16), torch.randn(32, 1)
    dls = dls_from(x, y, bs=8, n_valid=8)
    learn = fit(gan_critic(n_channels=3, nf=4, n_blocks=1), 'fp16', dls=dls, loss_func=lambda p, t: F.mse_loss(p.view(-1), t.view(-1)))
    assert all(math.isfinite(v) for v in learn.recorder.values[-1][:2])

class Held(nn.Module):
    "A fit's model that stops, in its first training forward and in that batch's backward, until the other thread has run its own model"
    def __init__(self, meet):
        super().__init__(); self.lin, self.head, self.meet, self.n = nn.Linear(4, 8), nn.Linear(8, 2), meet, 0
    def forward(self, x):
        h = self.lin(x)
        if self.training and self.n == 0:
            self.n = 1; self.meet('forward')
            h = _Meet.apply(h, self.meet)
        return self.head(h)

class _Meet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, meet): ctx.meet = meet; return h.view_as(h)
    @staticmethod
    def backward(ctx, g): ctx.meet('backward'); return g, None

@pytest.mark.parametrize('plan', ['fp16', 'bf16', 'autocast=False', 'split'])
def test_a_fit_in_another_thread_leaves_this_threads_modules_alone(plan):
    "Item 4: while a fit in another thread is in its forward or its backward, this thread's own model computes as plain fp32, and under its own autocast as plain autocast: no mode, hook or kernel of the fit acts on it"
    torch.manual_seed(0)
    mine, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)
    modes = []  # the torch function modes on in this thread while its own modules run
    mine[0].register_forward_hook(lambda m, a, o: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    ref = mine(x).detach()
    with torch.autocast('cpu', dtype=torch.bfloat16): ref16 = mine(x)
    seen, errs = [], []
    at, go = threading.Event(), threading.Event()
    def meet(where):  # the fit's thread: tell this one, wait until it ran its model
        seen.append(where); at.set(); go.wait(30); go.clear()
    def train():
        try: fit(Held(meet), plan)
        except BaseException: errs.append(traceback.format_exc())
        finally: at.set()
    t = threading.Thread(target=train); t.start()
    outs, auto = [], []
    for _ in range(2):  # the other fit's forward, then its backward
        assert at.wait(60); at.clear()
        outs.append(mine(x).detach())
        with torch.autocast('cpu', dtype=torch.bfloat16): auto.append(mine(x))
        go.set()
    t.join(120)
    assert not errs, errs
    assert seen == ['forward', 'backward']
    assert all(o.dtype == torch.float32 and torch.equal(o, ref) for o in outs)
    assert all(a.dtype == torch.bfloat16 and type(a.grad_fn) is type(ref16.grad_fn) and torch.equal(a, ref16) for a in auto)
    assert set(modes) == {0}

def _no_workers(dls):
    "`dls` loading in the fit's own thread: a DataLoader worker forked while another thread's fit runs can deadlock in the child"
    for dl in dls.loaders: dl.fake_l.num_workers = 0  # (what fastai does on macOS)
    return dls

@pytest.mark.parametrize('plan', ['fp16', 'split', 'autocast=False'])
def test_two_fits_in_two_threads(plan):
    "Item 4: two fits of one plan in two threads at once both train, each as it does alone"
    res, errs = {}, []
    def train(i):
        try:
            torch.manual_seed(i)
            res[i] = fit(tiny_model(seed=i), plan, epochs=2, dls=_no_workers(synth_dls(n=64, bs=16)))
        except BaseException: errs.append(traceback.format_exc())
    ts = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in ts: t.start()
    for t in ts: t.join(300)
    assert not errs, errs
    assert not any(t.is_alive() for t in ts), "a fit did not end in 300 s"
    for i in range(2): assert fp32_everywhere(res[i]) and all(math.isfinite(v) for v in res[i].recorder.values[-1][:2])

class Blk(nn.Module):
    "A block with an fp32 region inside it (a transformer's: a norm or a softmax in fp32)"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)
    def forward(self, x):
        h = F.relu(self.a(x))
        with torch.autocast('cpu', enabled=False): h = h.float() + 0.1 * self.b(h.float())
        return h

class Ckpt(nn.Module):
    "The block under activation checkpointing (timm's and Hugging Face's `gradient_checkpointing`), or not"
    def __init__(self, ckpt:bool): super().__init__(); self.blk, self.head, self.ckpt = Blk(), nn.Linear(8, 2), ckpt
    def forward(self, x): return self.head(checkpoint(self.blk, x, use_reentrant=False) if self.ckpt else self.blk(x))

def _threaded_backward():
    "torch's `backward` run in a second thread: what torch's engine does with a GPU's backward (a device thread of its own)"
    orig = torch.Tensor.backward
    def backward(self, *a, **k):
        err = []
        def run():
            try: orig(self, *a, **k)
            except BaseException as e: err.append(e)
        t = threading.Thread(target=run); t.start(); t.join()
        if err: raise err[0]
    return orig, backward

@pytest.mark.parametrize('thread', [False, True])
@pytest.mark.parametrize('plan', ['fp16', 'bf16', 'split', 'split_fp32_math', 'kahan'])
def test_checkpointing_changes_nothing(plan, thread):
    "Items 5 and 8: with activation checkpointing a fit ends with the weights it ends with without, as in fp32; the backward in the calling thread (a CPU's) or in another (a GPU's)"
    ends = {}
    orig, threaded = _threaded_backward()
    for ckpt in (False, True):
        torch.manual_seed(0)
        try:
            torch.Tensor.backward = threaded if thread else orig
            ends[ckpt] = params(fit(Ckpt(ckpt), plan, epochs=2))
        finally: torch.Tensor.backward = orig
    assert all(torch.equal(a, b) for a,b in zip(ends[False], ends[True]))

def penalty_loss(model):
    "A WGAN-GP style loss: the model run again on the inputs, the norm of its input grads (create_graph) added"
    def loss(pred, y):
        if not torch.is_grad_enabled(): return F.mse_loss(pred, y)  # validation
        x = model.xb.detach().requires_grad_()
        g, = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        model.outside.append(pred.dtype)
        return F.mse_loss(pred, y) + 0.01 * (g.norm(dim=1) - 1).pow(2).mean()
    return loss

class Twice(nn.Module):
    def __init__(self): super().__init__(); self.m, self.outside, self.xb = tiny_model(), [], None
    def forward(self, x): self.xb = x; return self.m(x)

class Outside(Callback):
    "A consistency loss's second forward in `after_pred`, a metric's forward in `after_batch`: the model at rest"
    order = 60
    def after_pred(self):
        out = self.model(self.xb[0] + 0.01)
        self.model.outside.append(out.dtype)
        self.learn.pred = self.pred + 0. * out.float().sum()
    def after_batch(self):
        with torch.no_grad(): self.model.outside.append(self.model(self.xb[0]).dtype)

@pytest.mark.parametrize('plan', ['fp32', 'split', 'kahan', 'stochastic', 'split_fp32_math'])
def test_lean_model_called_outside_its_forward(plan):
    "Item 6: under lean masters the model called in the loss (a gradient penalty), in `after_pred` and in `after_batch` computes as under fp32 masters at that moment: fp32"
    torch.manual_seed(0); m = Twice()
    learn = fit(m, plan, epochs=2, cbs=[Outside()], loss_func=penalty_loss(m))
    assert m.outside and set(m.outside) == {torch.float32}
    assert all(math.isfinite(v) for v in learn.recorder.values[-1][:2]) and fp32_everywhere(learn)

class Tied(nn.Module):
    "A language model's usual tie: the embedding's weight is the output head's"
    def __init__(self):
        super().__init__(); self.emb, self.mix = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False); self.head.weight = self.emb.weight
    def forward(self, ids): return self.head(F.relu(self.mix(self.emb(ids))))

def tied_dls():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (64, 5), generator=g)
    return dls_from(ids, ids.roll(1, 1), bs=16)

def test_split_reads_a_tied_embedding_as_fp32_masters_do():
    "Item 7: a tied embedding reads its exact fp32 value under split as under fp32 masters; the head's matmul its bf16 value as autocast casts it"
    seen = {}
    def spy(name):
        def f(m, a, out): seen.setdefault(name, []).append(out.detach().clone())
        return f
    for how in ('bf16', 'split'):
        torch.manual_seed(0); m = Tied()
        h = m.emb.register_forward_hook(spy(how))
        kw = dict(dtype='bf16', fp32_math=False) if how == 'bf16' else dict(plans['split'])
        learn = Learner(tied_dls(), m, loss_func=lambda p, t: F.cross_entropy(p.reshape(-1, 10), t.reshape(-1)), opt_func=SGD)
        learn.to_half(kw.pop('dtype'), **kw)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
        h.remove()
    assert seen['bf16'][0].dtype == seen['split'][0].dtype == torch.float32  # autocast leaves embeddings alone: fp32
    assert torch.equal(seen['bf16'][0], seen['split'][0])  # the first batch: the same fp32 values, exactly

@pytest.mark.parametrize('plan', ['fp16', 'split', 'bf16_native'])
def test_a_fit_inside_the_users_autocast_uses_each_steps_weights(plan):
    "Item 9: `learn.fit` inside the user's own torch.autocast trains as without it (autocast's cast cache freed at each batch, not reused)"
    ends = {}
    for outer in (False, True):
        torch.manual_seed(0)
        learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=SGD)
        p = dict(plans.get(plan, dict(dtype='bf16', fp32_math=False)))
        learn.to_half(p.pop('dtype'), init_scale=64. if plan == 'fp16' else 1., dynamic=False, **p)
        dt = torch.float16 if plan == 'fp16' else torch.bfloat16
        with warnings.catch_warnings(), learn.no_bar(), learn.no_logging():
            warnings.simplefilter('ignore')
            if outer:
                with torch.autocast('cpu', dtype=dt): learn.fit(2, 1e-2)
            else: learn.fit(2, 1e-2)
        ends[outer] = params(learn)
    assert all(torch.equal(a, b) for a,b in zip(ends[False], ends[True]))

def gan(dtype, seen):
    "A GAN whose losses are BCE on the critic's sigmoid: CUDA's autocast refuses BCE, so our loss must run at rest"
    from fastai.vision.gan import GANLearner
    torch.manual_seed(0)
    noise, real = torch.randn(64, 4), torch.randn(64, 8) * 0.5 + 1
    dls = DataLoaders.from_dsets(list(zip(noise, real)), list(zip(noise[:16], real[:16])), bs=8, shuffle=False, device='cpu')
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    crit = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid(), nn.Flatten(0))
    def bce(p, t):
        seen.append((torch.is_autocast_enabled('cpu'), p.dtype))
        return F.binary_cross_entropy(p, t)
    def gen_loss(fake_pred, output, target): return bce(fake_pred, torch.ones_like(fake_pred))
    def crit_loss(real_pred, fake_pred): return bce(real_pred, torch.ones_like(real_pred)) + bce(fake_pred, torch.zeros_like(fake_pred))
    crit[2].register_forward_hook(lambda m, a, out: seen.append(('critic', out.dtype)))
    learn = GANLearner(dls, gen, crit, gen_loss, crit_loss, lr=1e-3, opt_func=SGD)
    return learn.to_half(dtype, fp32_math=True) if dtype else learn

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_a_gans_loss_runs_fp32_and_its_models_in_half(dtype):
    "Item 10: a GAN's loss computes at rest in fp32 (on CUDA autocast refuses BCE), the models it calls in half"
    seen = []
    learn = gan(dtype, seen)
    with warnings.catch_warnings(), learn.no_bar(), learn.no_logging():
        warnings.simplefilter('ignore')
        learn.fit(1)
    losses = [s for s in seen if s[0] != 'critic']
    assert losses and set(losses) == {(False, torch.float32)}  # the loss: autocast off, fp32 inputs
    assert ('critic', _dt[dtype]) in seen  # the critic, also when the loss calls it, in half
    assert all(math.isfinite(v) for v in learn.recorder.values[-1][:2]) and fp32_everywhere(learn)

def test_a_compiled_lean_model_makes_no_more_graphs_than_fp32():
    "A `model.compile()`d model under split makes as many graphs as in fp32: the lean params' class stands aside in a trace"
    counts = {}
    for plan in ('fp32', 'split', 'split_fp32_math'):
        graphs = []
        def backend(gm, inputs): graphs.append(gm); return gm.forward
        torch._dynamo.reset(); torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)); m.compile(backend=backend)
        learn = fit(m, plan, epochs=2)
        counts[plan] = len(graphs)
        assert fp32_everywhere(learn) and all(math.isfinite(v) for v in learn.recorder.values[-1][:2])
    torch._dynamo.reset()
    assert counts['split'] <= counts['fp32'] and counts['split_fp32_math'] <= counts['fp32'], counts
