"The model as fastai trains it: other devices, GANs, tta, checkpoints across dtypes, events fired by hand, bad values"
import math, warnings, torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastai.callback.core import Callback
from fastai.callback.mixup import MixUp
from fastai_fp16.all import *
from helpers import *

class Where(Callback):
    "At a step (at rest): where the model and the optimizer's params are, and their dtypes"
    order = 9
    def before_step(self):
        self.seen = ({p.device.type for p in self.model.parameters()}, {p.dtype for p in self.model.parameters()},
                     {p.device.type for p in self.opt.all_params().itemgot(0)}, {p.dtype for p in self.opt.all_params().itemgot(0)})

def test_half_copies_made_where_fastai_moved_the_model():
    "DataLoaders on another device than the model (as on a GPU): fastai moves the model at `before_fit`; the half copies follow"
    class NewOpt(Callback):  # moving to `meta` makes new Parameters (to CUDA keeps them), so the optimizer is remade for them
        order = -9  # right after TrainEvalCallback moved the model
        def before_fit(self): self.learn.create_opt()
    learn = Learner(synth_dls(device='meta'), tiny_model(), loss_func=nn.MSELoss(), cbs=[NewOpt(), w := Where()]).to_half('fp16', guard_buffers=False)
    with pytest.raises(Exception, match='meta'): learn.fit(1)  # meta tensors hold no values: reading the overflow flag fails
    assert w.seen == ({'meta'}, {torch.float32}, {'meta'}, {torch.float32})  # the fp32 params at rest, stepped there
    assert {t.device.type for t in [*learn.model.parameters(), *learn.model.buffers()]} == {'meta'}  # and left there, fp32
    assert fp32_everywhere(learn) and opt_on_model(learn)

def wgan(dtype, clip=0.01, n=64, seed=0):
    from fastai.vision.gan import GANLearner
    torch.manual_seed(seed)
    noise, real = torch.randn(n, 4), torch.randn(n, 8) * 0.5 + 1
    dls = DataLoaders.from_dsets(list(zip(noise, real)), list(zip(noise[:16], real[:16])), bs=8, shuffle=False, device='cpu')
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    crit = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    learn = GANLearner.wgan(dls, gen, crit, clip=clip, lr=1e-3)
    return learn.to_half(dtype) if dtype else learn

class GANSpy(Callback):
    "After GANTrainer's clamp (order 0), before our `before_batch` (10): the critic's fp32 weights; at each step, what the optimizer steps"
    order = 9
    def before_fit(self): self.crit, self.steps = [], {True: [], False: []}
    def before_batch(self):
        if self.training: self.crit.append(max(p.abs().max().item() for p in self.model.critic.parameters()))
    def before_step(self):
        ps = [p for p in self.opt.all_params(with_grad=True).itemgot(0)]
        half = {id(p) for p in self.model.parameters() if p.dtype != torch.float32}
        self.steps[self.gan_trainer.gen_mode].append(({p.dtype for p in ps}, any(id(p) in half for p in ps)))

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_wgan_trains_both_models_in_fp32_with_the_clip(dtype):
    learn = wgan(dtype)
    g0 = [p.detach().clone() for p in learn.model.generator.parameters()]
    learn.fit(2, cbs=(spy := GANSpy()))
    assert spy.steps[True] and spy.steps[False]  # generator and critic steps both ran...
    for mode in (True, False): assert all(d == {torch.float32} and not h for d,h in spy.steps[mode]), mode  # ...on fp32 params
    assert len(spy.crit) == 16 and max(spy.crit) <= 0.01  # the critic's fp32 weights clamped at every batch, in flight from them
    assert any(not torch.equal(p, q) for p,q in zip(learn.model.generator.parameters(), g0))  # the generator trained
    assert fp32_everywhere(learn) and opt_on_model(learn)

class Dtypes(Callback):
    order = 20
    def before_fit(self): self.seen = set()
    def after_pred(self): self.seen.add(next(self.model.parameters()).dtype)

def test_tta_runs_as_get_preds():
    "fastai's `tta` fires `before_fit` without `learn.lock`: it is no fit, so it runs in `get_preds`' precision"
    learn = Learner(exportable_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=(d := Dtypes())).to_half('fp16')
    learn.fit(1, 1e-2)
    preds, _ = learn.get_preds()
    assert d.seen == {torch.float32}  # the params (fp32: what a module computes with in flight is no param)
    (aug, tta), _ = learn.tta(n=1, beta=None)
    assert d.seen == {torch.float32} and torch.equal(tta, preds)
    assert fp32_everywhere(learn)

class ScaleSeen(Callback):
    order = 20
    def before_backward(self):
        if not hasattr(self, 'first'): self.first = (self.mixed_precision.loss_scale, self.mixed_precision.scaler.dynamic)

@pytest.mark.parametrize('saved,loaded,expect', [('bf16', 'fp16', (2.**16, True)), ('fp16', 'bf16', (1., False))])
def test_checkpoint_of_the_other_dtype_starts_its_own_scaler(tmp_path, saved, loaded, expect):
    a = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), path=tmp_path).to_half(saved, growth_interval=2)
    a.fit(1, 1e-2); a.save('ck')
    assert torch.load(tmp_path/'models/ck.pth', weights_only=False)['opt']['mixed_precision']['dtype'] == str(half_dtype(saved))
    b = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), path=tmp_path).to_half(loaded, growth_interval=2); b.load('ck')
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        b.fit(1, 1e-2, cbs=(s := ScaleSeen()))
    assert s.first == expect
    assert b.mixed_precision.state_dict()['dtype'] == str(half_dtype(loaded))
    assert any("run's" in str(w.message) for w in ws) == (saved == 'fp16')  # a dynamic scale that moved is said dropped

def test_bad_values_refused():
    with pytest.raises(ValueError, match='clip'): MixedPrecision(clip=float('nan'))
    with pytest.raises(ValueError, match='clip'): MixedPrecision(clip=float('inf'))
    with pytest.raises(ValueError, match='init_scale'): Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', init_scale=float('inf'))
    with pytest.raises(ValueError, match='init_scale'): MixedPrecision(init_scale=float('nan'))

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_mixup_preview_by_hand(dtype):
    "fastai's docs preview MixUp by firing events by hand in `with learn:` (no fit, no optimizer)"
    dls = synth_dls()
    with assume_capabilities(cpu_caps('avx512_bf16')):  # bf16: fast here, so the model is half
        with Learner(dls, tiny_model(), loss_func=nn.MSELoss(), cbs=MixUp(1.)).to_half(dtype) as learn:
            learn.epoch, learn.training = 0, True
            learn.dl = dls.train
            b = dls.one_batch()
            learn._split(b)
            learn('before_train')
            seen = InForward(lambda m: m[0], lambda l, o: o.dtype, valid=True)
            seen.learn = learn; seen.before_fit()  # a hook on the first layer: what it computes
            learn('before_batch')
            assert learn.xb[0].dtype == torch.float32  # the batch as it comes: the model casts it as it gets it
            assert learn.model[0].weight.dtype == torch.float32  # the model's own fp32 params, always...
            learn.model(*learn.xb); seen.after_fit()
            assert seen.seen == {half_dtype(dtype)}  # ...computing in half (fp32 math where its kernels are slow: as fits run)
            assert learn.opt is None
    assert fp32_everywhere(learn)

def test_one_batch_without_before_fit_says_why():
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16')
    learn.create_opt()
    with pytest.raises(RuntimeError, match='before_fit'): learn.one_batch(0, learn.dls.one_batch())
    assert fp32_everywhere(learn)

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_fastai_channels_last_is_kept(dtype):
    "fastai's `ChannelsLast` (order -1) changes the memory format after `before_fit` starts: masters and the model after keep it"
    from fastai.callback.channelslast import ChannelsLast
    x, y = torch.randn(16, 3, 8, 8), torch.randn(16, 2)
    dls = DataLoaders.from_dsets(list(zip(x[:8], y[:8])), list(zip(x[8:], y[8:])), bs=4, device='cpu')
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(dls, conv, loss_func=nn.MSELoss(), cbs=ChannelsLast()).to_half(dtype)
    learn.fit(1, 1e-2)
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last) and fp32_everywhere(learn)
