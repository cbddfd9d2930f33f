"EMA of the weights: fp32, from the params the optimizer steps; the usual deepcopy EMA works too, the model being fp32 at rest"
import copy, zipfile, torch, torch.nn as nn, pytest
from fastcore.test import test_eq as eq, test_ne as ne, test_close as close  # not test_*: pytest would collect them
from fastai.learner import Learner, load_learner
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai.callback.training import GradientAccumulation
from fastai_fp16.all import *
from fastai_fp16.ema import EMA
from helpers import *

def flat(ts): return torch.cat([t.detach().float().reshape(-1) for t in ts])

class NaiveEMA(Callback):
    "The usual EMA (timm's `ModelEmaV2`, fastxtend's `EMACallback`): `deepcopy(learn.model)`, averaged in place after each step"
    order = 11
    def __init__(self, decay): self.decay = decay
    def before_fit(self): self.ema_model = copy.deepcopy(self.learn.model)
    def after_step(self):
        with torch.no_grad():
            for a,w in zip(self.ema_model.parameters(), self.learn.model.parameters()): a.mul_(self.decay).add_(w, alpha=1-self.decay)

class Weights(Callback):
    "The true fp32 value of each param after each optimizer step that ran (and of the float buffers)"
    order = 100
    def before_fit(self): self.seen, self.bufs, self.cancelled = [], [], False
    def after_cancel_step(self): self.cancelled = True
    def after_step(self):
        if self.cancelled: self.cancelled = False; return
        self.seen.append([p.detach().float().clone() for p in self.learn.model.parameters()])  # at rest: the fp32 params
        self.bufs.append([b.detach().float().clone() for b in self.learn.model.buffers() if b.is_floating_point()])

def by_hand(w0, seen, decay, every=1, warmup=False):
    avg, n = [w.clone() for w in w0], 0
    for i,ws in enumerate(seen, 1):
        if i % every: continue
        d = min(decay, (1+n)/(10+n)) if warmup else decay
        avg, n = [a.lerp(w, 1-d) for a,w in zip(avg, ws)], n+1
    return avg, n

def tiny_fit(dtype=None, cbs=(), epochs=4, lr=0.1, dls=None, **kw):
    "tiny_model from the same start, 16 SGD steps an epoch"
    learn = Learner(dls or synth_dls(n=171, bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=SGD, cbs=list(cbs))
    if dtype: learn.to_half(dtype, **kw)
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, lr)
    return learn, w0

@pytest.mark.parametrize('dtype,kw', [('bf16', {}), ('fp16', dict(init_scale=2.**8))])  # 2**8: no fp16 overflow, the same 64 steps
def test_ours_and_the_usual_deepcopy_ema_match_the_fp32_runs(dtype, kw):
    ref, w0 = tiny_fit(cbs=[EMA(0.9998), NaiveEMA(0.9998)])
    learn, _ = tiny_fit(dtype, [EMA(0.9998), NaiveEMA(0.9998)], **kw)
    eq((ref.ema.n_updates, learn.ema.n_updates, learn.mixed_precision.skipped), (64, 64, 0))
    start, ref_ema = flat(w0), flat(ref.ema.avg.values())
    unit = (ref_ema - start).norm()
    noise = ((flat(learn.model.parameters()) - flat(ref.model.parameters())).norm() / (flat(ref.model.parameters()) - start).norm()).item()
    ours, naive = flat(learn.ema.avg.values()), flat(learn.naive_ema.ema_model.parameters())
    moved = lambda e: ((e - start).norm() / unit).item()
    off = lambda e: ((e - ref_ema).norm() / unit).item()
    close(flat(ref.naive_ema.ema_model.parameters()), ref_ema, eps=1e-4)  # in fp32 the usual EMA is right
    assert abs(moved(ours) - 1) < 0.1 and off(ours) <= noise + 0.05, (moved(ours), off(ours), noise)
    # the model is fp32 at rest, so a third-party EMA reading it after each step is right too (with a half model between
    # steps it moved 0.48x (bf16) and 1.22x (fp16) the fp32 EMA's distance)
    assert abs(moved(naive) - 1) < 0.1 and off(naive) <= noise + 0.05, (moved(naive), off(naive), noise)

def test_skipped_steps_are_not_averaged():
    learn, w0 = tiny_fit('fp16', [EMA(0.9), spy := Weights()], epochs=1, init_scale=2.**24)  # the first steps overflow
    skipped = learn.mixed_precision.skipped
    assert skipped >= 1 and len(spy.seen) == 16 - skipped
    avg, n = by_hand(w0, spy.seen, 0.9)
    eq(learn.ema.n_updates, n)
    assert all(torch.equal(a, b) for a,b in zip(learn.ema.avg.values(), avg))

@pytest.mark.parametrize('every,warmup', [(1, False), (3, True)])
def test_fp32_learner_is_the_ema_by_hand(every, warmup):
    learn, w0 = tiny_fit(cbs=[EMA(0.95, every=every, warmup=warmup, buffers='ema'), spy := Weights()], epochs=2)
    avg, n = by_hand(w0, spy.seen, 0.95, every, warmup)
    eq(learn.ema.n_updates, n)
    names = [k for k,_ in learn.model.named_parameters()]
    assert all(torch.equal(learn.ema.avg[k], a) for k,a in zip(names, avg))
    b0 = [b.float() for b in tiny_model().buffers() if b.is_floating_point()]  # BatchNorm's stats, averaged with 'ema'
    bavg, _ = by_hand(b0, spy.bufs, 0.95, every, warmup)
    eq([learn.ema.avg[k] for k in ('1.running_mean', '1.running_var')], bavg)

def test_only_real_steps_count_with_gradient_accumulation():
    learn, _ = tiny_fit('bf16', [GradientAccumulation(16), EMA(0.9), spy := Weights()], epochs=1)
    eq((learn.ema.n_updates, len(spy.seen)), (8, 8))  # 16 batches of 8, a step per 16 items

def test_applied_and_validate_restore_the_weights_bit_for_bit():
    mk = lambda v: tiny_fit('bf16', [EMA(0.9, validate=v)], epochs=2)[0]
    plain, learn = mk(False), mk(True)
    eq(flat(learn.model.parameters()), flat(plain.model.parameters()))  # EMA validation left training alone
    eq(flat(learn.ema.avg.values()), flat(plain.ema.avg.values()))
    ne(learn.recorder.values[-1][1], plain.recorder.values[-1][1])
    w, bufs = flat(learn.model.parameters()), flat(learn.model.buffers())
    with learn.ema.applied():
        eq(flat(learn.model.parameters()), flat(learn.ema.avg.values()))
        learn.validate()
    eq((flat(learn.model.parameters()), flat(learn.model.buffers())), (w, bufs))
    with pytest.raises(KeyboardInterrupt):
        with learn.ema.applied(): raise KeyboardInterrupt
    eq(flat(learn.model.parameters()), w)
    with learn.ema.applied(), pytest.raises(RuntimeError, match='inside `with learn.ema.applied'): learn.fit(1)
    # an fp32 fit validating on the average shows the loss `validate` gives on it after the fit
    learn, _ = tiny_fit(cbs=[EMA(0.9, validate=True)], epochs=1)
    shown = learn.recorder.values[-1][1]  # before `validate` resets the Recorder
    with learn.ema.applied(): close(learn.validate()[0], shown)

class Seen(Callback):
    "The params' values as validation starts (before `EMA`, order 4, swaps in the average)"
    order = 3
    def before_validate(self): self.w = flat(self.learn.model.parameters())
class Boom(Callback):
    order = 100
    def after_batch(self):
        if not self.training: raise KeyboardInterrupt

def test_a_fit_raising_mid_validation_gets_its_training_weights_back():
    # no masters: the params are half for the whole fit; ModelToHalf's cleanup makes fp32 what ours put back
    learn = Learner(synth_dls(n=171, bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=SGD,
                    cbs=[EMA(0.9, validate=True), seen := Seen(), Boom()]).to_half('bf16', master_weights=False)
    with pytest.raises(KeyboardInterrupt): learn.fit(1, 0.1)
    assert fp32_everywhere(learn)
    # the training weights (bf16 between steps, fp32 after: a tensor the fit left as it was gets its exact fp32 value back)
    eq(flat(learn.model.parameters()).bfloat16(), seen.w.bfloat16())
    ne(flat(learn.ema.avg.values()), seen.w)
    assert not hasattr(learn.ema, '_run')

def test_export_and_load_learner(tmp_path):
    learn = Learner(exportable_dls(), nn.Linear(4, 2), loss_func=nn.MSELoss(), opt_func=SGD, path=tmp_path,
                    cbs=EMA(0.9)).to_half('bf16')
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 0.1)
    learn.export('weights.pkl')
    with learn.ema.applied(): learn.export('ema.pkl')
    for f in ('weights.pkl', 'ema.pkl'):
        mods = exported_modules(tmp_path/f)  # what loading it imports (a path naming a `fastai_fp16` folder is none of it)
        assert 'fastai.learner' in mods and not any(m.split('.')[0] == 'fastai_fp16' for m in mods), mods
    w, e = load_learner(tmp_path/'weights.pkl'), load_learner(tmp_path/'ema.pkl')
    assert not hasattr(w, 'ema') and fp32_everywhere(e)
    eq(flat(w.model.parameters()), flat(learn.model.parameters()))
    eq(flat(e.model.parameters()), flat(learn.ema.avg.values()))
    ne(flat(e.model.parameters()), flat(learn.model.parameters()))
    torch.save(learn.ema.state_dict(), tmp_path/'ema.pth')
    m = nn.Linear(4, 2); m.load_state_dict(torch.load(tmp_path/'ema.pth'))
    eq(flat(m.parameters()), flat(learn.ema.avg.values()))
    other = Learner(exportable_dls(), nn.Linear(4, 2), loss_func=nn.MSELoss(), cbs=EMA(0.9))
    other.ema.load_state_dict(learn.ema.state_dict(), n_updates=learn.ema.n_updates)
    eq((flat(other.ema.avg.values()), other.ema.n_updates), (flat(learn.ema.avg.values()), 6))

def test_across_fits_and_not_in_lr_find_validate_get_preds():
    learn, _ = tiny_fit('bf16', [EMA(0.99)], epochs=1)
    avg = flat(learn.ema.avg.values())
    with learn.no_bar(), learn.no_logging():
        learn.validate(); learn.get_preds(); learn.lr_find(num_it=10, show_plot=False, suggest_funcs=())
        eq((flat(learn.ema.avg.values()), learn.ema.n_updates), (avg, 16))
        learn.fit(1, 0.1)
    eq(learn.ema.n_updates, 32); ne(flat(learn.ema.avg.values()), avg)
    learn.ema.reset()
    with pytest.raises(ValueError, match='no average yet'):
        with learn.ema.applied(): pass

class Reader(Callback):
    "A third-party callback reading the params during a fit, at rest (after a step): what it sees"
    order = 20
    def after_step(self):
        ps, stepped = list(self.learn.model.parameters()), list(self.learn.opt.all_params().itemgot(0))
        self.dtypes, self.is_opts = {p.dtype for p in ps}, [id(p) for p in ps] == [id(p) for p in stepped]
        sd = self.learn.model.state_dict()
        self.sd_ok = all(torch.equal(sd[n], p) for n,p in self.learn.model.named_parameters())
        self.w = flat(ps)

def test_a_callback_reading_params_mid_fit_sees_the_fp32_params_the_optimizer_steps():
    learn, _ = tiny_fit('bf16', [r := Reader()], epochs=1)
    eq(r.dtypes, {torch.float32})
    assert r.is_opts and r.sd_ok
    assert not torch.equal(r.w.bfloat16().float(), r.w)  # finer than bf16

def test_a_new_model_is_said_at_the_users_fit_line():
    "Issue 56.8: the EMA's 'not those it averaged' warning names the user's `fit` line, at each fit that meets it"
    import warnings
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=EMA(0.9)).to_half('bf16')
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 0.1)
    with warnings.catch_warnings(record=True) as ws, learn.no_bar(), learn.no_logging():
        warnings.simplefilter('default')
        for m in (nn.Linear(4, 2), tiny_model()):
            learn.model = m  # another model: the average's tensors are not its
            learn.fit(1, 0.1)  # a new model: said here
    said = [w for w in ws if 'not those it averaged' in str(w.message)]
    src = open(__file__).read().splitlines()
    assert len(said) == 2 and all(w.filename == __file__ and 'said here' in src[w.lineno - 1] for w in said), [(w.filename, w.lineno) for w in said]
