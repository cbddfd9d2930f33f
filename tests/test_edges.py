"Outside the common path: failed validation entries, a part's checkpoint during a fit, the two-dtypes hint, `to_fp32`"
import torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastai.callback.core import Callback
from fastai.callback.rnn import ModelResetter
import fastai.callback.hook  # Learner.summary
from fastai_fp16.all import *
from helpers import *

class Boom(Callback):
    "Raises at `event`: another callback failing after ours made the model half"
    order = 20
    def __init__(self, event): self.event = event
    def before_fit(self):
        if self.event == 'before_fit': raise RuntimeError('boom')
    def before_validate(self):
        if self.event == 'before_validate': raise RuntimeError('boom')

def _quiet_fit(learn, *args):
    with learn.no_bar(), learn.no_logging(): learn.fit(*args)

@pytest.mark.parametrize('event', ['before_fit', 'before_validate'])
@pytest.mark.parametrize('how', ['get_preds', 'validate', 'tta'])
def test_failed_validation_leaves_exact_fp32_and_next_fit_clean(how, event):
    torch.manual_seed(0)
    learn = Learner(exportable_dls(), nn.Sequential(nn.Linear(4, 2)), loss_func=nn.MSELoss()).to_half('bf16')
    w = learn.model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match='boom'):
        if how == 'tta': learn.add_cb(Boom(event)); learn.tta()
        else: getattr(learn, how)(cbs=Boom(event))
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, Boom)])
    assert fp32_everywhere(learn) and torch.equal(learn.model[0].weight, w)
    assert learn.model(torch.ones(1, 4)).dtype == torch.float32  # a plain call works: no mixed dtypes
    assert not learn.lock.locked()  # the next `validate` does not hang
    learn.validate()
    _quiet_fit(learn, 1, 0)
    assert fp32_everywhere(learn) and torch.equal(learn.model[0].weight, w)  # a clean fit, not a "nested" one

def test_failed_get_preds_inside_a_fit_takes_back_only_its_nesting():
    class PredsMidFit(Callback):
        order = 30
        def after_epoch(self):
            with pytest.raises(RuntimeError, match='boom'): self.learn.get_preds(cbs=Boom('before_fit'))
            self.depth = self.learn.model_to_half._depth
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=(pm := PredsMidFit())).to_half('bf16')
    _quiet_fit(learn, 1, 1e-2)
    assert pm.depth == 1 and fp32_everywhere(learn) and opt_on_model(learn)

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_a_parts_state_dict_during_a_fit_holds_fp32_values(dtype):
    "A part's checkpoint at `after_epoch` (a GAN's generator, an encoder): fp32, the values the fit trained and ends with"
    class PartState(Callback):
        order = 20
        def after_epoch(self): self.part = {k: v.clone() for k,v in self.model[0].state_dict().items()}
    seen = InForward(lambda m: m[0], lambda l, o: (o.dtype, *(p.dtype for p in l.model[0].parameters())))
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[ps := PartState(), seen]).to_half(dtype)
    _quiet_fit(learn, 2, 1e-2)
    assert seen.seen == {(half_dtype(dtype), torch.float32, torch.float32)}  # the part computed in half, its params fp32
    assert {v.dtype for v in ps.part.values()} == {torch.float32}
    for n,p in learn.model[0].named_parameters(): assert torch.equal(ps.part[n], p)  # the fit's last values

def _awd_lstm_learner(dtype, model=None, cbs=None):
    from fastai.text.models.awdlstm import AWD_LSTM
    from fastai.text.models.core import get_language_model
    from fastai.losses import CrossEntropyLossFlat
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (48, 8), generator=g), torch.randint(0, 20, (48, 8), generator=g)
    dls = DataLoaders.from_dsets(list(zip(x[:32], y[:32])), list(zip(x[32:], y[32:])), bs=16, shuffle=False, device='cpu')
    cfg = dict(emb_sz=8, n_hid=16, n_layers=2, pad_token=1, hidden_p=0., input_p=0., embed_p=0., weight_p=0.,
               tie_weights=True, output_p=0., out_bias=True)
    if model is None: model = get_language_model(AWD_LSTM, 20, cfg)  # its hidden state is made now, in fp32
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=cbs).to_half(dtype)

class KeepsState(nn.Module):
    "An LSTM that carries its hidden state across batches, made with the model (fp32), as fastai's `AWD_LSTM`"
    def __init__(self): super().__init__(); self.emb, self.rnn, self.out = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 20); self.reset()
    def reset(self): p = self.out.weight; self.hidden = (p.new_zeros(1, 16, 8), p.new_zeros(1, 16, 8))
    def forward(self, x):
        out, h = self.rnn(self.emb(x), self.hidden)
        self.hidden = tuple(t.detach() for t in h)
        return self.out(out)

class StateDtype(Callback):
    "The dtypes of the hidden state the LSTM gets in flight, and of the state the model holds after the fit"
    order = 20
    def before_fit(self): self.seen = set()
    def after_pred(self):
        h = getattr(self.model, 'hidden', None)
        if h is not None: self.seen.add(h[0].dtype)

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_rnn_state_made_at_rest_is_cast_in_flight(dtype):
    "An RNN's hidden state made fp32 (before the fit, or by fastai's `ModelResetter` at rest) meets half weights: cast, as autocast does"
    # (fastai 2.8.7's AWD_LSTM fails on torch 2.14's LSTM from its second batch, in fp32 too: a model of the same kind)
    learn = _awd_lstm_learner(dtype, model=KeepsState())
    _quiet_fit(learn, 1, 1e-3)  # a hidden state made with the model, before the fit: fp32
    assert all(torch.isfinite(l) for l in learn.recorder.losses) and fp32_everywhere(learn)
    learn = _awd_lstm_learner(dtype, KeepsState(), cbs=[ModelResetter(), sd := StateDtype()])  # reset at rest: fp32
    _quiet_fit(learn, 1, 1e-3)
    assert sd.seen == {half_dtype(dtype)} and learn.model.hidden[0].dtype == torch.float32  # reset after the fit, at rest
    assert fp32_everywhere(learn) and all(torch.isfinite(l) for l in learn.recorder.losses)

class MakesFp32(nn.Module):
    "A forward that makes an fp32 tensor and adds half activations into it: the usual cause of the two-dtypes error"
    def __init__(self): super().__init__(); self.lin = nn.Linear(4, 2)
    def forward(self, x): return torch.zeros(x.shape[0], 2).index_add(0, torch.arange(x.shape[0]), self.lin(x))

@pytest.mark.parametrize('how', ['fit', 'summary', 'get_preds', 'validate', 'tta', 'predict'])
def test_two_dtypes_hint_at_every_entry_point(how):
    learn = Learner(exportable_dls(), MakesFp32(), loss_func=nn.MSELoss()).to_half('bf16')
    w = learn.model.lin.weight.detach().clone()
    # a CPU with fast bf16 kernels, where inference runs bf16 too (without them `validate`/`get_preds` run fp32: no error)
    with assume_capabilities(cpu_caps('avx512_bf16')), pytest.raises(RuntimeError) as e, learn.no_bar(), learn.no_logging():
        if how == 'fit': learn.fit(1)
        elif how == 'predict': learn.predict(0)
        else: getattr(learn, how)()
    notes = [n for n in getattr(e.value, '__notes__', []) if 'fastai_fp16' in n]
    assert len(notes) == 1 and 'tensor made inside `forward`' in notes[0]  # once, the right cause
    assert fp32_everywhere(learn) and torch.equal(learn.model.lin.weight, w)

@pytest.mark.parametrize('method', ['to_fp32', 'to_non_native_fp32'])
def test_fastais_to_fp32_ends_half_training(method):
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', channels_last=True)
    class Dt(Callback):
        def after_pred(self): self.dt = self.model[0].weight.dtype
    getattr(learn, method)()
    learn.add_cb(d := Dt())
    _quiet_fit(learn, 1, 1e-2)
    assert d.dt == torch.float32 and not [cb for cb in learn.cbs if getattr(cb, '_fp16_role', None)]
