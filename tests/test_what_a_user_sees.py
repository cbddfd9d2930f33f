"""What a fastai user sees around a half fit, each against plain fp32: the progress table and `CSVLogger` hold fastai's rows of
stats only, a skipped step's NaN loss stays out of `train_loss`, warnings name the user's line at every fit, `summary()`
counts as fp32 does, older names for the loss scale's settings are read as ours, and the refusal of fastai's own mixed
precision names a fix that works when followed."""
import io, contextlib, re, tempfile, warnings
import torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.fp16 import MixedPrecision as FastaiMP
from fastai.callback.hook import *  # `learn.summary()`
from fastai_fp16.all import *
from helpers import *

class NaNAt(Callback):
    "NaN inputs (bad data) at the given training batches of every epoch"
    order = 0
    def __init__(self, at=(1,)): self.at = at
    def before_batch(self):
        if self.training and self.iter in self.at: self.learn.xb = (self.xb[0] * float('nan'),)

def learner(cbs=(), **kw):
    return Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss(), path=tempfile.mkdtemp(), cbs=list(cbs), **kw)

def fit_printing(learn, *args, **kw):
    "fit with fastai's progress table on (its console form, as in a script); what it printed"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(*args, **kw)
    return out.getvalue()

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_the_table_and_the_csv_log_hold_rows_of_stats_only(dtype):
    "A fit with skipped steps: the CSV log reads back every epoch under fp32's columns, the summary is a line below the table"
    ref = learner([CSVLogger()])
    fit_printing(ref, 2, 1e-2)
    learn = learner([CSVLogger()]).to_half(dtype, init_scale=256., dynamic=False)
    text = fit_printing(learn, 2, 1e-2, cbs=NaNAt())
    log, log32 = learn.csv_logger.read_log(), ref.csv_logger.read_log()
    assert list(log.columns) == list(log32.columns) and len(log) == len(log32) == 2 and log.train_loss.notna().all(), log
    lines = [l.strip() for l in text.replace('\r', '\n').splitlines() if l.strip() and 'Epoch' not in l]
    rows = [l for l in lines if re.match(r'^\d+\s', l)]
    assert [r.split()[0] for r in rows] == ['0', '1']  # the table's rows: its epochs, nothing else
    assert lines[-1] == 'fastai_fp16: 2 optimizer steps skipped: 2 on an inf/NaN loss (left out of train_loss).', lines
    assert lines.index(rows[-1]) == len(lines) - 2  # the line comes after the table

def test_a_users_logger_gets_lists_of_stats():
    "A user's own `learn.logger` gets what fastai gives it, lists of stats, in a half fit with skips as in fp32"
    got = {}
    for how in ('fp32', 'fp16'):
        learn = learner()
        if how == 'fp16': learn.to_half('fp16', init_scale=2.**24)  # the dynamic scale's search: overflow skips
        rows = []
        with learn.no_bar(), contextlib.redirect_stdout(io.StringIO()):
            learn.logger = rows.append
            learn.fit(2, 1e-2)
        got[how] = rows
        if how == 'fp16': assert learn.mixed_precision.skipped_overflow >= 1
    assert all(not isinstance(r, str) and len(r) == len(got['fp32'][0]) for r in got['fp16'])
    assert len(got['fp16']) == len(got['fp32'])

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_a_skipped_nan_batch_is_left_out_of_the_smoothed_loss(dtype):
    "fastai's smoothed loss takes the batches the weights trained on: no NaN, one count a step taken, the curve as long as `lrs`"
    learn = learner().to_half(dtype, init_scale=256., dynamic=False)
    with learn.no_bar(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(2, 1e-2, cbs=NaNAt((1, 4)))
    rec = learn.recorder
    assert learn.mixed_precision.skipped_bad_loss == 4
    assert all(torch.isfinite(torch.as_tensor(v)) for v in rec.losses) and len(rec.losses) == len(rec.lrs) == 12
    assert rec.smooth_loss.count == 12 - 4 and all(v == v for v in rec.values[-1])
    ref = learner()  # fp32 takes the NaN into its smoothed loss (and its weights): the batch, not the precision, is bad
    with ref.no_bar(): ref.fit(1, 1e-2, cbs=NaNAt((1,)))
    assert torch.isnan(torch.as_tensor(ref.recorder.losses[-1]))

def test_the_nan_warning_is_said_at_every_fit_at_the_fit_line():
    "Under Python's default filter: an fp16 fit, then a bf16 fit, from the same line; each warns, naming that line"
    ws = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('default')
        for dtype in ('fp16', 'bf16'):
            learn = learner().to_half(dtype, init_scale=256., dynamic=False)
            with learn.no_bar(): learn.fit(1, 1e-2, cbs=NaNAt())  # the line named
        ws = [w for w in rec if 'the loss was inf or NaN' in str(w.message)]
    assert len(ws) == 2 and {w.filename for w in ws} == {__file__}
    src = open(__file__).read().splitlines()
    assert all('learn.fit(1, 1e-2, cbs=NaNAt())  # the line named' in src[w.lineno - 1] for w in ws)

def _counts(learn):
    "`summary()`'s totals: (params, trainable, non-trainable)"
    with contextlib.redirect_stdout(io.StringIO()): s = str(learn.summary())
    return tuple(int(re.search(rf'{k}: ([\d,]+)', s)[1].replace(',', '')) for k in
                 ('Total params', 'Total trainable params', 'Total non-trainable params'))

@pytest.mark.parametrize('dtype', ['fp16', 'bf16', 'auto'])
def test_summary_counts_as_fp32(dtype):
    "`summary()` (and fastai's `layer_info` under it) reports fp32's counts, a frozen layer non-trainable in both"
    def make():
        learn = learner()
        for p in learn.model[0].parameters(): p.requires_grad_(False)  # a frozen layer
        return learn
    want = _counts(make())
    assert want[1] and want[2]  # some of each
    learn = make().to_half(dtype)
    assert _counts(learn) == want
    learn.fit(1, 1e-2)
    assert _counts(learn) == want and fp32_everywhere(learn)

def test_older_names_for_the_scale_are_read_as_ours():
    "The study's `loss_scale`, `scale_wait`, `div_factor`, `max_loss_scale`, fastai v1's `max_noskip`: read as ours, said once"
    with pytest.warns(UserWarning, match='`loss_scale=512` as `init_scale=512.0`') as rec:
        learn = learner().to_half('fp16', loss_scale=512, scale_wait=50, div_factor=4., max_loss_scale=2.**20)
    assert len([r for r in rec if 'older names' in str(r.message)]) == 1
    want = LossScaler(init_scale=512., growth_interval=50, growth_factor=4., backoff_factor=.25, max_scale=2.**20)
    assert learn.mixed_precision.scaler.state_dict() == want.state_dict()
    with pytest.warns(UserWarning, match='older names'): mp = MixedPrecision(loss_scale=128., dynamic=False, max_noskip=10)
    assert (mp.scaler.scale, mp.scaler.dynamic, mp.scaler.growth_interval) == (128., False, 10)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn)
    with pytest.raises(TypeError, match='given twice'): learner().to_half('fp16', init_scale=8., loss_scale=512)
    with pytest.raises(TypeError, match=re.escape("learn.to_half('fp16')")): learner().to_half(amp_mode='fp16')
    with pytest.raises(TypeError, match="did you mean 'growth_interval'"): learner().to_half('fp16', growth_intervall=5)
    with pytest.raises(TypeError, match=re.escape("did you mean 'loss_scale' (an older name, read as `init_scale`)?")):
        learner().to_half('fp16', loss_scael=512)  # an older name, misspelt
    with pytest.raises(TypeError, match="did you mean 'scale_wait'"): learner().to_half('fp16', scale_wiat=512)
    with pytest.raises(ValueError, match='div_factor'): learner().to_half('fp16', div_factor=.5)

def test_the_refusal_of_fastais_mixed_precision_names_a_fix_that_works():
    "fastai's `MixedPrecision` beside `to_half()`: passed to `fit(cbs=...)`, or added to the Learner; each advice followed trains ours alone"
    learn = learner().to_half('fp16', init_scale=256.)
    with pytest.raises(ValueError) as e: learn.fit(1, cbs=FastaiMP())
    lines = [l for l in str(e.value).splitlines() if not l.startswith('Exception occured')]  # fastai's line naming the event
    text = ' '.join(lines)
    assert 'passed to this fit' in text and 'leave it out of `cbs=`' in text and 'added by' not in text, text  # the one place
    assert len(lines) <= 4 and max(map(len, lines)) <= 120, lines  # a few lines a user reads
    learn.fit(1, 1e-2)  # left out of `cbs=`, as it says
    assert type(learn.mixed_precision) is MixedPrecision
    learn.add_cb(FastaiMP())
    with pytest.raises(ValueError) as e: learn.fit(1)
    fix = re.search(r'alone with `([^`]*)`', str(e.value))[1]
    assert 'on the Learner' in str(e.value) and fix == 'remove_fastai_precision(learn)'
    eval(fix, {'learn': learn, 'remove_fastai_precision': remove_fastai_precision})  # as it says
    assert type(learn.mixed_precision) is MixedPrecision  # the name is ours again
    learn.fit(1, 1e-2)
    assert [type(cb) for cb in learn.cbs if 'MixedPrecision' in type(cb).__name__] == [MixedPrecision]
    assert fp32_everywhere(learn) and learn.mixed_precision.skipped == 0
    with pytest.raises(ValueError, match=r"(?s)MixedPrecision passed to this fit .*leave it out of `cbs=`"): learn.fit(1, cbs=MixedPrecision())
    learn.fit(1, 1e-2)  # ours, passed a second time: left out, as it says
    assert type(learn.mixed_precision) is MixedPrecision and fp32_everywhere(learn)

def test_a_cancelled_fits_line_starts_a_line_of_its_own():
    "fastai's console bar (a script, a terminal) leaves its line open when `TerminateOnNaNCallback` cancels the fit mid-epoch: our line starts after it"
    from fastprogress.fastprogress import ConsoleProgressBar
    from fastai.callback.tracker import TerminateOnNaNCallback
    from fastai.callback.progress import ProgressCallback
    outs = {}
    for bar in (True, False):
        learn = learner([ProgressCallback()] if not any(isinstance(cb, ProgressCallback) for cb in learner().cbs) else [])
        learn.to_half('fp16', init_scale=256., dynamic=False)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings(), (contextlib.nullcontext() if bar else learn.no_bar()):
            warnings.simplefilter('ignore')
            learn.fit(2, 1e-2, cbs=[NaNAt((3,)), TerminateOnNaNCallback()])
        if bar: assert isinstance(learn.progress.pbar, ConsoleProgressBar) and learn.progress.pbar.last_v == 3  # left open at 3 of 6
        text = out.getvalue()
        i = text.index('fastai_fp16: 1 optimizer step skipped: 1 on an inf/NaN loss')
        assert i == 0 or text[i - 1] == '\n', repr(text[max(0, i - 80):i + 20])  # not run on from the bar's `... 40%...]`
        outs[bar] = text
    assert ']' in outs[True].split('fastai_fp16:')[0].splitlines()[-1]  # the bar's line was there, open, before it

def test_warnings_name_the_users_line_at_every_fit():
    "The 'already half' and slow-kernels warnings name the user's `fine_tune`/`fit_one_cycle` line, at each fit; 'already half' lists the dtypes the model had"
    src = open(__file__).read().splitlines()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('default')
        for _ in range(2):
            m = tiny_model().half()
            learn = Learner(synth_dls(n=128, bs=16), m, loss_func=nn.MSELoss()).to_half('bf16')
            with learn.no_bar(): learn.fine_tune(1, 1e-2)  # warns here: half
        with assume_capabilities(cpu_caps('avx2')):
            learn = Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', fp32_math=False)
            with learn.no_bar():
                for _ in range(2): learn.fit_one_cycle(1, 1e-2)  # warns here: slow
    half = [w for w in rec if 'already half' in str(w.message)]
    slow = [w for w in rec if 'slow native kernels' in str(w.message)]
    assert len(half) == 2 and len(slow) == 2, [str(w.message)[:60] for w in rec]
    assert all(w.filename == __file__ and src[w.lineno - 1].strip().endswith(('# warns here: half', '# warns here: slow')) for w in half + slow)
    assert 'tensors in torch.float16' in str(half[0].message) and 'torch.float32' not in str(half[0].message).split(')')[0]

def test_a_min_scale_set_too_high_is_named_with_readable_scales():
    "`LossScaleError`: scales as powers of two, and a `min_scale` the gradients overflow at is the first thing to lower"
    class Inf(Callback):
        order = 5
        def after_backward(self):
            if self.training: self.model[0].weight.grad[0, 0] = float('inf')
    learn = learner().to_half('fp16', init_scale=2.**21, min_scale=2.**20)
    with pytest.raises(LossScaleError) as e, learn.no_bar(): learn.fit(1, 1e-2, cbs=Inf())
    msg = str(e.value)
    assert 'minimum loss scale (2**20 (1048576))' in msg and '1.04858e+06' not in msg, msg
    assert msg.index('min_scale=2**20 (1048576) may be set too high') < msg.index('a lower learning rate'), msg

def test_validate_after_a_fit_gives_the_fits_figures():
    "bf16 on an AVX2 CPU (fp32 math): `validate()` after the fit runs as the fit's validation, so its loss is the table's"
    with assume_capabilities(cpu_caps('avx2')):
        learn = learner().to_half('bf16')
        with learn.no_bar(): learn.fit(1, 1e-2)
        fit_loss = learn.recorder.values[-1][1]  # the table's valid_loss
        assert abs(learn.validate()[0] - fit_loss) < 1e-6
        ref = learner()  # fp32's figure differs: the fit ran bf16
        ref.model.load_state_dict(learn.model.state_dict())
        assert ref.validate()[0] != learn.validate()[0]
