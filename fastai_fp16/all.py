"Every public name of fastai_fp16; importing it also adds `Learner.to_half` / `Learner.to_float`."
from .core import *
from .scaler import *
from .hardware import *
from .fp32math import *
from .doctor import *
from .guard import *
from .conflicts import *
from .half_model import *
from .fused_adam import *
from .callbacks import *
from .learner import *
from .data import *
from .experiments import *
from .monitor import *
from .bench_overhead import *
from .bench import *
from .torch_optim import *
