"""Run with `torchrun --nproc_per_node 2 tests/dist_train.py OUT_DIR DTYPE [MASTERS]`: 2 CPU processes (gloo), each rank seeded
apart (DDP's broadcast of rank 0's weights is what makes ranks agree), a NaN on rank 1 only. DTYPE: fp16, bf16 or fp32.
A `PrecisionMonitor` looks on: on the Learner (before `DistributedTrainer`, which wraps the model in DDP) for fp16, given
to `fit` (after it) otherwise. With lean masters (MASTERS: split, kahan, stochastic) a pruning callback writes the weights
through `.data` on every rank, and the fit saves mid-fit."""
import sys, torch, torch.nn as nn
from pathlib import Path
from fastai.learner import Learner
from fastai.optimizer import Adam
from fastai.callback.core import Callback
from fastai.distributed import DistributedDL, rank_distrib
from fastai_fp16.all import *

def _broadcast_cpu(self, t, rank):
    "fastai 2.8.7 moves these indices through `.cuda()`; gloo works on CPU tensors"
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()
DistributedDL._broadcast = _broadcast_cpu

_all_reduce, reduced = torch.distributed.all_reduce, set()
def _recorded(t, *args, **kwargs):
    "The dtypes all-reduced from Python: DDP's comm hook's buckets, our overflow flag"
    reduced.add(t.dtype); return _all_reduce(t, *args, **kwargs)
torch.distributed.all_reduce = _recorded

class NaNOnRank1(Callback):
    order = 11  # the batch as the DataLoader gave it (the model casts it in flight)
    def before_batch(self):
        if self.training and self.iter == 2 and rank_distrib() == 1: self.learn.xb = (self.xb[0] * float('nan'),)

class Prune(Callback):
    "A pruning callback on every rank (one mask, from a fixed seed): each Linear weight times its mask after every step, through `.data`"
    order = 50
    def before_fit(self):
        g = torch.Generator().manual_seed(7)
        self.ms = [m for m in self.learn.model.modules() if isinstance(m, nn.Linear)]
        self.masks = [(torch.rand(m.weight.shape, generator=g) > .5).float() for m in self.ms]
        self._apply()
    def after_step(self): self._apply()
    def _apply(self):
        for m,k in zip(self.ms, self.masks): m.weight.data.mul_(k)
    def after_fit(self): self.zero = all(bool((m.weight[k == 0] == 0).all()) for m,k in zip(self.ms, self.masks))

class SaveEach(Callback):
    "Saves mid-fit at each epoch (rank 0 writes): with lean masters, the fit goes on under DDP after it"
    order = 70
    def after_epoch(self): self.learn.save(f'ep{self.epoch}', with_opt=True)

out, dtype = Path(sys.argv[1]), sys.argv[2]
masters = sys.argv[3] if len(sys.argv) > 3 else 'fp32'  # bf16's lean masters: 'split', 'kahan', 'stochastic'
rank = int(__import__('os').environ['RANK'])
pm = PrecisionMonitor(every=3)
learn = Learner(synth_dls(n=128, bs=16), tiny_model(seed=rank), loss_func=nn.MSELoss(), opt_func=Adam,
                cbs=[NaNOnRank1()] + ([pm] if dtype == 'fp16' else []) + ([SaveEach(), Prune()] if masters != 'fp32' else []), path=out)
if dtype != 'fp32': learn.to_half(dtype, init_scale=256. if dtype == 'fp16' else 1., growth_interval=3, masters=masters)
with learn.distrib_ctx(sync_bn=False): learn.fit(2, 1e-2, cbs=[] if dtype == 'fp16' else [pm])
mp = getattr(learn, 'mixed_precision', None)
torch.save({'params': [p.detach() for p in learn.model.parameters()], 'opt': [learn.opt.state[p].get('grad_avg') for p in learn.model.parameters()],
            'scale': mp and mp.loss_scale, 'skipped': mp and mp.skipped, 'scales': mp and list(mp.scales),
            'dtypes': {p.dtype for p in learn.model.parameters()}, 'overflows': pm.overflows,
            'records': pm.records, 'metric_names': list(learn.recorder.metric_names),
            'values': [list(v) for v in learn.recorder.values], 'reduced': reduced, 'path': str(out),
            'pruned': getattr(getattr(learn, 'prune', None), 'zero', None)}, out/f'rank{rank_distrib()}.pt')
