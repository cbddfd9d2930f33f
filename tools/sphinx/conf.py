"""Sphinx settings for the docs site; tools/docs.py runs Sphinx on `_proc/` (the processed notebooks) with these."""
from nbdev.config import get_config

cfg = get_config()
project = html_title = cfg.title
author, copyright = cfg.author, cfg.copyright
extensions = ['myst_nb', 'sphinx_copybutton']
root_doc = 'index'
exclude_patterns = ['.cache', '.doctrees', 'jupyter_execute', 'screenshots', '**/.ipynb_checkpoints']  # _proc/'s own files

nb_execution_mode = 'off'             # tools/docs_nb.py ran the notebooks (with nbdev_test's skips and a cache)
nb_render_markdown_format = 'myst'    # show_doc and DataFrame markdown outputs have tables; CommonMark has none
myst_enable_extensions = ['colon_fence']  # `:::{note}`, what quarto's `::: {.callout-note}` becomes
myst_all_links_external = True        # links are already the site's `page.html#anchor` (tools/docs_myst.py)
suppress_warnings = ['myst.header']   # show_doc's `###` can follow a page title directly, as in nbdev's pages

html_theme = 'furo'
html_static_path = ['_static']       # relative to this folder
html_css_files = ['docs.css']
html_show_sourcelink = False          # the "source" is a processed copy, not what anyone should edit
html_copy_source = False
copybutton_exclude = '.linenos, .gp, .go'

def _outputs_in_proc(app):
    # MyST-NB writes the notebooks' images next to the output folder, i.e. into the repository root: keep them in _proc/
    app.env.mystnb_config = app.env.mystnb_config.copy(output_folder=str(cfg.config_path/'_proc'/'jupyter_execute'))

def setup(app): app.connect('builder-inited', _outputs_in_proc, priority=900)  # after MyST-NB's own (500)
