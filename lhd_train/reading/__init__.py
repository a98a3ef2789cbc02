"""Reading: lhd's application of the lens library (`lens/`) to its own data.

It turns a run directory (`runs`) or a probe set into chat prompts with tagged positions, has the
library read margins at those positions (`read`: one `collect`, one pre-registration), and turns
the margins into AUROC tables (`tables`) and result files (`report`). `general_corpus` writes fit
corpora from run transcripts; `entitle` reads the judge-free experiment's answers. The library
below it takes tensors, positions and token sets and knows no run (docs/lens.md)."""
