"""One module per model family: how its Hugging Face config maps onto ModelConfig's options and
its checkpoint's tensor names onto the decoder's (model/decoder.py). model/registry.py lists them."""
