"""trl_grpo_ext/compat.py: each call detects the feature (a keyword, an attribute), so both spellings work."""

from trl_grpo_ext.compat import cache_kwargs, merge_and_unload, output_cache, set_active_adapter


class _NewPeft:
    def __init__(self):
        self.calls = []

    def set_adapter(self, name, inference_mode=False):
        self.calls.append(("set_adapter", name, inference_mode))

    def set_requires_grad(self, name, requires_grad=True):
        self.calls.append(("set_requires_grad", name, requires_grad))


class _OldPeft(_NewPeft):
    def set_adapter(self, name):  # always trainable
        self.calls.append(("set_adapter", name))


def test_set_active_adapter_newer_peft_takes_inference_mode():
    model = _NewPeft()
    set_active_adapter(model, "a", trainable=False)
    set_active_adapter(model, "b", trainable=True)
    assert model.calls == [("set_adapter", "a", True), ("set_adapter", "b", False)]


def test_set_active_adapter_older_peft_is_frozen_afterwards():
    model = _OldPeft()
    set_active_adapter(model, "a", trainable=False)
    set_active_adapter(model, "b", trainable=True)
    assert model.calls == [("set_adapter", "a"), ("set_requires_grad", "a", False), ("set_adapter", "b")]


def test_merge_and_unload_leaves_no_peft_config():
    class Base:
        pass

    base = Base()
    base.peft_config = {"default": object()}  # what older peft leaves behind

    class Peft:
        def merge_and_unload(self):
            return base

    assert merge_and_unload(Peft()) is base and not hasattr(base, "peft_config")


def test_cache_keyword_follows_the_forward_signature():
    class New:
        config = None

        def forward(self, input_ids=None, cache=None): ...

    class Old:
        config = None

        def forward(self, input_ids=None, past_key_values=None): ...

    assert cache_kwargs(New(), "c") == {"cache": "c"} and cache_kwargs(Old(), "c") == {"past_key_values": "c"}

    class Out:
        past_key_values = "old"

    assert output_cache(Out()) == "old"
    Out.cache = "new"
    assert output_cache(Out()) == "new"
