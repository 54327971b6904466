"""Model coverage across families, vision-language models, real weights."""
