"""The seed study: its data (`data`), peak memory (`memory`), the precision ladder (`ladder`), each claim checked
(`claims`, `practice`, `lean`) and the verdict table (`run`). `from fastai_fp16.study import ...` gives the claims' names, as the
module `fastai_fp16.study` did before it became this folder."""
from .claims import *
from .claims import __all__
