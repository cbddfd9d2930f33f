"Lean masters (`to_half('bf16', masters='split'|'kahan'|'stochastic')`) in fits as users run them, each against fp32 masters"
import copy, pickle, tempfile, pytest, torch, torch.nn as nn
from functools import partial
from pathlib import Path
from fastai.learner import Learner
from fastai.optimizer import Adam, SGD, RAdam, Lamb, OptimWrapper, ranger
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.callback.tracker import SaveModelCallback
from fastai_fp16.all import *
from fastai_fp16.masters import join_fp32
from helpers import params, exportable_dls

LEAN = ('split', 'kahan', 'stochastic')

class Seen(Callback):
    "Per training batch: the model's param dtypes at rest (after_batch), the optimizer state's keys, and the fp32 masters after each step"
    order = 20
    def before_fit(self): self.dtypes, self.keys, self.masters = set(), set(), []
    def _lean(self): return getattr(getattr(self.learn.__dict__.get('mixed_precision'), '_run', None), 'lean', None)
    def after_step(self):
        lean = self._lean()
        self.masters.append([(lean.master(p) if lean else p).detach().float().clone() for p in self.model.parameters()])
    def after_batch(self):
        if not self.training: return
        self.dtypes |= {p.dtype for p in self.model.parameters()}
        self.keys |= {k for p in self.model.parameters() for k in self.opt.state[p]}
        self.bits = len(lean.bits) if (lean := self._lean()) else 0

def learner(masters='fp32', opt_func=Adam, cbs=(), n=64, **kw):
    learn = Learner(synth_dls(n=n), tiny_model(), loss_func=nn.MSELoss(), opt_func=opt_func, cbs=[Seen(), *cbs])
    return learn.to_half('bf16', masters=masters, **kw)

def fit(learn, epochs=2, lr=1e-2, **kw):
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, lr, **kw)
    return learn

def no_bits(learn): return learn.mixed_precision.lean is None or not learn.mixed_precision.lean.bits  # none left after the fit

@pytest.mark.parametrize('masters', LEAN)
def test_trains_lean_in_the_fit_fp32_after(masters):
    ref, learn = fit(learner()), fit(learner(masters))
    s = learn.seen
    assert s.dtypes == {torch.bfloat16, torch.float32}  # the Linear params bf16 at rest, BatchNorm's fp32
    assert (s.bits > 0) == (masters in ('split', 'kahan')) and not s.keys - {'grad_avg', 'sqr_avg', 'step', 'do_wd', 'force_train'}  # the bits kept apart
    assert ref.seen.dtypes == {torch.float32}  # fp32 masters: fp32 at rest
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and no_bits(learn)  # after: plain fp32
    assert all(torch.equal(p, m) for p, m in zip(learn.model.parameters(), s.masters[-1]))  # the masters' exact values
    l0, l1 = ref.recorder.values[-1][0], learn.recorder.values[-1][0]
    assert abs(l0 - l1) / l0 < 0.05, (l0, l1)  # the loss as fp32 masters'

@pytest.mark.parametrize('opt_func', [Adam, SGD, RAdam, Lamb, partial(OptimWrapper, opt=torch.optim.AdamW)], ids=['adam', 'sgd', 'radam', 'lamb', 'torch_adamw'])
def test_split_steps_as_fp32_masters(opt_func):
    "Every step whose weights and grads are fp32 masters' ends in fp32 masters' weights, bit for bit"
    a, b = fit(learner(opt_func=opt_func), 3), fit(learner('split', opt_func=opt_func), 3)
    ea = [torch.equal(x, y) for ms, ns in zip(a.seen.masters, b.seen.masters) for x, y in zip(ms, ns)]
    assert all(ea), ea.index(False)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), tiny_model().parameters()))  # and they moved

def test_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"to_half\('bf16', masters='split'\)"): learner('split').to_float().to_half('fp16', masters='split')
    with pytest.raises(ValueError, match='master_weights=False'): learner('kahan', master_weights=False)
    with pytest.raises(ValueError, match="one of \\['fp32', 'split', 'kahan', 'stochastic'\\]"): learner('lean')
    plain = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=ranger)
    w = params(plain)
    with pytest.raises(ValueError, match="Lookahead") as e: plain.to_half('bf16', masters='split')  # at `to_half`, not at the fit
    assert not any(type(cb).__module__.startswith('fastai_fp16') for cb in plain.cbs)  # left as it was
    assert all(torch.equal(p, q) and p.dtype == torch.float32 for p, q in zip(plain.model.parameters(), w)) and plain.opt is None
    at_fit = learner('split')  # the fit's refusal, of an optimizer made after `to_half`, says the same
    at_fit.opt_func = ranger
    with pytest.raises(ValueError) as e2: fit(at_fit)
    assert str(e.value) in str(e2.value)

@pytest.mark.parametrize('masters', LEAN)
def test_resume_is_exact(masters):
    "Saved mid-fit (fp32 weights, the masters' exact values) and resumed: the same end as the fit that went on"
    with tempfile.TemporaryDirectory() as d:
        class SaveAt(Callback):
            order = 70
            def after_epoch(self):
                if self.epoch == 0:
                    self.learn.save('ep0', with_opt=True); self.w = [m.clone() for m in self.learn.seen.masters[-1]]
        a = learner(masters, cbs=[SaveAt()]); a.path = Path(d); fit(a, 2)
        sd = torch.load(Path(d)/'models'/'ep0.pth', weights_only=False)
        assert all(t.dtype == torch.float32 for t in sd['model'].values() if t.is_floating_point())
        assert all(torch.equal(sd['model'][n], w) for (n, _), w in zip(a.model.named_parameters(), a.save_at.w))  # exact masters
        assert not any(k in ('master_lo', 'kahan_comp') for s in sd['opt']['state'] for k in s)  # their bits are in the weights
        assert a.seen.dtypes >= {torch.bfloat16}  # the fit went on lean after the save
        b = learner(masters); b.path = Path(d); b.load('ep0', with_opt=True)
        assert all(torch.equal(p, w) for p, w in zip(b.model.parameters(), a.save_at.w))
        fit(b, 1)
        assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))

@pytest.mark.parametrize('masters', LEAN)
def test_export_gives_fp32_exact(masters):
    with tempfile.TemporaryDirectory() as d:
        class ExportAt(Callback):
            order = 70
            def after_epoch(self):
                if self.epoch == 0: self.learn.export(Path(d)/'mid.pkl'); self.w = [m.clone() for m in self.learn.seen.masters[-1]]
        learn = Learner(exportable_dls(), tiny_model(), loss_func=nn.MSELoss(), path=d, cbs=[Seen(), ExportAt()]).to_half('bf16', masters=masters)
        fit(learn, 2)
        mid = torch.load(Path(d)/'mid.pkl', weights_only=False)
        assert all(p.dtype == torch.float32 and torch.equal(p, w) for p, w in zip(mid.model.parameters(), learn.export_at.w))
        assert learn.seen.dtypes >= {torch.bfloat16} and no_bits(learn)  # went on lean with the new optimizer export made
        learn.export(Path(d)/'end.pkl')
        end = torch.load(Path(d)/'end.pkl', weights_only=False)
        assert all(p.dtype == torch.float32 and torch.equal(p, q) for p, q in zip(end.model.parameters(), learn.model.parameters()))
        assert all(torch.equal(p, q) for p, q in zip(pickle.loads(pickle.dumps(learn.model)).parameters(), learn.model.parameters()))

class Stop(Callback):
    order = 20
    def __init__(self, exc): self.exc = exc  # a class: a new exception each fit
    def after_batch(self):
        if self.training and self.iter == 1: self.w = [m.clone() for m in self.learn.seen.masters[-1]]; raise self.exc('a bug in a callback')

@pytest.mark.parametrize('masters', LEAN)
@pytest.mark.parametrize('exc', [CancelFitException, RuntimeError], ids=['cancelled', 'raised'])
def test_stopped_fit_leaves_fp32_masters(masters, exc):
    learn = learner(masters, cbs=[Stop(exc)])
    if exc is RuntimeError:
        with pytest.raises(RuntimeError, match='a bug'): fit(learn)
    else: fit(learn)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and no_bits(learn)
    assert all(torch.equal(p, w) for p, w in zip(learn.model.parameters(), learn.stop.w))
    learn.remove_cb(learn.stop); fit(learn.to_float(), 1)  # and a plain fp32 fit goes on from them

class NaNAt(Callback):
    order = 11
    def before_batch(self):
        if self.training and self.iter == 2: self.learn.xb = (self.xb[0] * float('nan'),)

@pytest.mark.parametrize('masters', LEAN)
def test_skipped_step_leaves_masters(masters):
    learn = fit(learner(masters, cbs=[NaNAt()]), 1)
    assert learn.mixed_precision.skipped == 1
    m = learn.seen.masters  # after_step runs for a cancelled step too: its masters are the step before's
    assert all(torch.equal(x, y) for x, y in zip(m[1], m[2])) and not all(torch.equal(x, y) for x, y in zip(m[0], m[1]))
    assert all(p.isfinite().all() for p in learn.model.parameters())

@pytest.mark.parametrize('masters', LEAN)
def test_accumulation_and_clipping(masters):
    for cbs, kw in ((lambda: [GradientAccumulation(32)], {}), (lambda: [GradientClip(0.1)], {}), (lambda: [], dict(clip=0.1))):
        ref, learn = fit(learner(cbs=cbs(), **kw)), fit(learner(masters, cbs=cbs(), **kw))
        moved = [(p - q).abs().max() for p, q in zip(learn.model.parameters(), tiny_model().parameters())]
        assert all(m > 1e-4 for m in moved)
        l0, l1 = ref.recorder.values[-1][0], learn.recorder.values[-1][0]
        assert abs(l0 - l1) / l0 < 0.05, (cbs, l0, l1)

def test_split_with_ema_averages_the_masters():
    a = fit(learner(cbs=[EMA(decay=0.9)]), 2); b = fit(learner('split', cbs=[EMA(decay=0.9)]), 2)
    assert all(torch.equal(x, y) for x, y in zip(a.ema.avg.values(), b.ema.avg.values()))
    with b.ema.applied(): assert all(p.dtype == torch.float32 for p in b.model.parameters())

def test_bf16_states():
    class States(Callback):
        order = 20
        def after_batch(self):
            if self.training: self.seen = {v.dtype for p in self.model.parameters() for k, v in self.opt.state[p].items() if k in ('grad_avg', 'sqr_avg') and p.dtype == torch.bfloat16}
    ref, learn = fit(learner()), fit(learner('split', cbs=[States()], opt_states='bf16'))
    assert learn.states.seen == {torch.bfloat16}
    # after the fit the params are fp32, the lean ones' states still bf16 (fp32 ones would take more than the fit held)
    lin = {id(p) for m in learn.model if isinstance(m, nn.Linear) for p in m.parameters()}
    dts = lambda ps: {v.dtype for p in ps for k, v in learn.opt.state[p].items() if k in ('grad_avg', 'sqr_avg')}
    assert dts(p for p in learn.model.parameters() if id(p) in lin) == {torch.bfloat16}
    assert dts(p for p in learn.model.parameters() if id(p) not in lin) == {torch.float32}  # BatchNorm's: fp32 all along
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    l0, l1 = ref.recorder.values[-1][0], learn.recorder.values[-1][0]
    assert abs(l0 - l1) / l0 < 0.05, (l0, l1)

def test_scaler_state_round_trips_lean_steps():
    learn = fit(learner('stochastic'), 1)
    mp = learn.mixed_precision
    assert mp.lean.steps == 3 and mp.state_dict()['lean_steps'] == 3
    mp2 = MixedPrecision(masters='stochastic'); mp2.load_state_dict(mp.state_dict())
    assert mp2.state_dict() == mp.state_dict()

@pytest.mark.parametrize('cls', ['avx2', 'amx'])
def test_any_cpu_class(cls):
    "bf16 storage with fp32 math (an AVX2 CPU) or native bf16 (AMX): lean masters as fp32 masters, in either plan"
    with assume_capabilities(cpu_caps(cls)):
        a, b = fit(learner()), fit(learner('split'))
    assert b.seen.dtypes == {torch.bfloat16, torch.float32}
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))

def test_export_or_load_mid_ddp_fit_refused(tmp_path):
    "Mid-fit under DDP the params must keep their dtype (DDP hooks their grads): export/load there say what to do instead"
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/pg', rank=0, world_size=1)
    try:
        class WrapThenExport(Callback):
            order = 12
            def before_fit(self): self.learn.model = DistributedDataParallel(self.learn.model)  # as DistributedTrainer (11) does
            def after_batch(self):
                if self.training and self.iter == 1: self.learn.export(tmp_path/'x.pkl')
        learn = learner('split', cbs=[WrapThenExport()])
        with pytest.raises(ValueError, match=r"`learn.export` in a DDP fit with masters='split'.*after the fit"): fit(learn)
        learn.model = learn.model.module
        assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and no_bits(learn)
    finally: dist.destroy_process_group()

@pytest.mark.parametrize('masters', LEAN)
def test_lr_find_and_fine_tune(masters):
    "lr_find leaves the model and optimizer as it found them; fine_tune's frozen epoch leaves the body bit for bit, then trains it"
    import fastai.callback.schedule
    from fastai.torch_core import params as ps_of
    class Body(Callback):
        order = 70
        def before_fit(self): self.w = [p.detach().float().clone() for p in self.model[0].parameters()]
        def after_fit(self): self.moved = not all(torch.equal(p, w) for p, w in zip(self.model[0].parameters(), self.w))
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), splitter=lambda m: [ps_of(m[0]), ps_of(m[1:])], cbs=[Body()])
    learn.to_half('bf16', masters=masters)
    w = params(learn)
    with learn.no_bar(), learn.no_logging():
        learn.lr_find(num_it=5, show_plot=False)
        assert all(p.dtype == torch.float32 for p in learn.model.parameters()) and no_bits(learn)
        # split: as it found them; kahan and stochastic hold a trained param in fewer bits from the fit's start (~16, or bf16's 8)
        tol = dict(split=0, kahan=2**-15, stochastic=2**-8)[masters]
        assert all(((p - q).abs() <= tol * q.abs()).all() for p, q in zip(learn.model.parameters(), w))
        learn.fine_tune(1, 1e-2, freeze_epochs=1)
    assert learn.body.moved  # unfrozen: trained
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def test_frozen_body_stays_exact():
    from fastai.torch_core import params as ps_of
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), splitter=lambda m: [ps_of(m[0]), ps_of(m[1:])]).to_half('bf16', masters='stochastic')
    learn.freeze(); w = params(learn)
    fit(learn, 1)
    assert all(torch.equal(p, q) for p, q in zip(learn.model[0].parameters(), w[:2]))  # frozen: its fp32 values, not rounded
    assert not all(torch.equal(p, q) for p, q in zip(list(learn.model.parameters())[2:], w[2:]))

@pytest.mark.parametrize('masters', LEAN)
def test_load_mid_fit_goes_on_lean_from_the_loaded_weights(masters, tmp_path):
    src = fit(learner()); src.path = tmp_path; src.save('w', with_opt=True)  # an fp32-masters checkpoint
    saved = params(src)
    class LoadAt(Callback):
        order = 70
        def after_epoch(self):
            if self.epoch == 0:
                self.learn.load('w', with_opt=True)
                lean = self.learn.mixed_precision._run.lean
                self.seen = ([lean.master(p).clone() for p in self.model.parameters()], {p.dtype for p in self.model.parameters()})
    learn = learner(masters, cbs=[LoadAt()]); learn.path = tmp_path
    fit(learn, 2)
    vals, dts = learn.load_at.seen
    assert dts == {torch.bfloat16, torch.float32}  # lean again after the load
    if masters == 'split': assert all(torch.equal(v, s) for v, s in zip(vals, saved))
    assert learn.seen.masters[-1] and not all(torch.equal(v, s) for v, s in zip(learn.seen.masters[-1], saved))  # then trained on

def wide_learner(masters='fp32', chunk=None, opt_func=Adam, cbs=(), **kw):
    "Params of 160 and 80 elements: with `chunk=64` they step in slices (of 64) where the optimizer's update is elementwise"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 40), nn.ReLU(), nn.Linear(40, 2))
    learn = Learner(synth_dls(n=64), model, loss_func=nn.MSELoss(), opt_func=opt_func, cbs=[Seen(), *cbs]).to_half('bf16', masters=masters, **kw)
    if learn.mixed_precision.lean: learn.mixed_precision.lean.chunk = chunk
    return learn

class Fresh(Callback):
    "The workspace's count of new allocations after each step; whether the step was the fused kernel's"
    order = 20
    def before_fit(self): self.counts = []
    def after_step(self): self.counts.append(self.learn.mixed_precision._run.lean.ws.fresh); self.fused = self.learn.mixed_precision.fused

@pytest.mark.parametrize('masters', LEAN)
@pytest.mark.parametrize('opt', ['fused_adam', 'adam', 'sgd', 'radam', 'lamb', 'torch_adamw'])
def test_slices_step_as_the_whole_param(masters, opt):
    "A param stepped in slices ends bit for bit where it ends stepped whole (the fused kernel, fastai's steppers, torch's); Lamb is never sliced"
    opt_func = dict(fused_adam=Adam, adam=Adam, sgd=partial(SGD, mom=0.9), radam=RAdam, lamb=Lamb, torch_adamw=partial(OptimWrapper, opt=torch.optim.AdamW))[opt]
    kw = dict(fused_step=False) if opt == 'adam' else {}
    whole, sliced = fit(wide_learner(masters, None, opt_func, **kw), 2), fit(wide_learner(masters, 64, opt_func, cbs=[Fresh()], **kw), 2)
    assert sliced.fresh.fused == (opt == 'fused_adam')
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), sliced.model.parameters()))
    assert all(torch.equal(x, y) for ms, ns in zip(whole.seen.masters, sliced.seen.masters) for x, y in zip(ms, ns))  # every step
    assert not all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), wide_learner().model.parameters()))  # they moved
    c = sliced.fresh.counts
    assert c[0] > 0 and c[-1] == c[0], c  # the first step sizes the workspace; after it a step takes no new memory

def test_slices_with_bf16_states_and_fp32_masters():
    "bf16 states widened a slice at a time: the whole param's end; split with slices steps as fp32 masters"
    a, b = fit(wide_learner('split', None, opt_states='bf16'), 2), fit(wide_learner('split', 64, opt_states='bf16'), 2)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    ref, c = fit(wide_learner(), 2), fit(wide_learner('split', 64), 2)
    ea = [torch.equal(x, y) for ms, ns in zip(ref.seen.masters, c.seen.masters) for x, y in zip(ms, ns)]
    assert sum(ea) >= len(ea) // 2, ea  # bf16 forwards round ties apart (see test_split_steps_as_fp32_masters): most steps equal

def test_bf16_states_of_a_torch_optimizer():
    "torch's own states (an `OptimWrapper`'s `opt.state`, not fastai's) kept bf16 at rest, fp32 for each step"
    class TorchStates(Callback):
        order = 20
        def after_batch(self):
            if self.training: self.seen = {v.dtype for st in self.opt.opt.state.values() for k, v in st.items() if k.startswith('exp_avg')}
    adamw = partial(OptimWrapper, opt=torch.optim.AdamW)
    ref, learn = fit(learner(opt_func=adamw)), fit(learner('split', opt_func=adamw, cbs=[TorchStates()], opt_states='bf16'))
    assert learn.torch_states.seen == {torch.bfloat16, torch.float32}  # the Linear params' bf16, BatchNorm's (fp32 params) fp32
    assert {v.dtype for st in learn.opt.opt.state.values() for k, v in st.items() if k.startswith('exp_avg')} == {torch.bfloat16, torch.float32}  # kept so after the fit
    l0, l1 = ref.recorder.values[-1][0], learn.recorder.values[-1][0]
    assert abs(l0 - l1) / l0 < 0.05, (l0, l1)

def test_to_float_after_bf16_states_trains_as_plain_fp32():
    "Issue 56.7: `to_float()` after fits with `opt_states='bf16'` makes the optimizer's states fp32: the next fit is a plain fp32 fit from those weights and states"
    learn = fit(learner('split', opt_states='bf16'), 1)
    states = lambda l: [(k, v) for p in l.model.parameters() for k, v in l.opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim]
    assert torch.bfloat16 in {v.dtype for _, v in states(learn)}  # bf16 between half fits
    learn.to_float()
    assert {v.dtype for _, v in states(learn)} == {torch.float32}
    ref = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss())  # plain fp32, from the same weights and (fp32) states
    ref.model.load_state_dict(learn.model.state_dict()); ref.create_opt(); ref.opt.load_state_dict(copy.deepcopy(learn.opt.state_dict()))  # fastai shares, not copies
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(states(ref), states(learn)))
    fit(learn, 1); fit(ref, 1)
    assert all(torch.equal(p, q) for p, q in zip(learn.model.parameters(), ref.model.parameters()))

def saturating_split(x, hi, lo):
    "`split_into` on a device whose narrowing int32 -> int16 copy saturates (as MPS's float -> int8 does, pytorch#169058)"
    xi = x.view(torch.int32)
    lo.copy_(xi.clamp(-2**15, 2**15 - 1)); hi.view(torch.int16).copy_(xi.add_(0x8000).bitwise_right_shift_(16))

def test_the_bit_operations_are_checked_once_a_process_per_device_type(monkeypatch):
    "Issue 54: each lean mode's bit operations give a CPU's known answers here; checked once, at the first lean fit"
    import fastai_fp16.bit_check as bc
    monkeypatch.setattr(bc, '_verdicts', {})
    calls = []
    ops = bc._ops
    monkeypatch.setattr(bc, '_ops', lambda dev, fns: calls.append(dev) or ops(dev, fns))
    for m in LEAN: fit(learner(m), epochs=1)
    assert calls == [torch.device('cpu')] and set(bc._verdicts['cpu'].values()) == {None}

@pytest.mark.parametrize('masters', LEAN)
def test_a_device_whose_bit_operations_differ_is_refused(monkeypatch, masters):
    "A lean mode whose ops give other answers on the fit's device is refused, naming it and `masters=`, before anything changes"
    import fastai_fp16.bit_check as bc, fastai_fp16.masters as fm
    monkeypatch.setattr(bc, '_verdicts', {})
    monkeypatch.setattr(fm, 'split_into', saturating_split)
    learn = learner(masters)
    w = params(learn)
    if masters == 'split':
        with pytest.raises(ValueError, match=r"masters='split' keeps .* on cpu they do not give a CPU's answers \(split gave"): fit(learn)
        assert all(torch.equal(a, b) for a, b in zip(w, params(learn))) and {p.dtype for p in learn.model.parameters()} == {torch.float32}
    else: fit(learn)  # Kahan's and stochastic rounding's ops are not the split's
