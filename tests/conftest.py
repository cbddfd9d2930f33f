import warnings, pytest, torch
warnings.filterwarnings('ignore', category=FutureWarning)  # torch.jit deprecation noise from fastai's imports

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
