"""Loading: model names and files -> config, params and tokenizer (loaders, tokenizer, catalog, hub,
store), and the stored device programs and compile cache. Imports rjax.math and below."""
