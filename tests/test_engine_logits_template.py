"""next_token_logits honours chat-template options, as stream_chat does."""
import torch

CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_next_token_logits_continues_final_message_like_chat(engine):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    logits = engine.next_token_logits(messages=messages, template_kwargs=CONTINUE)
    first = engine.chat(messages, max_new_tokens=1, template_kwargs=CONTINUE).token_ids[0]
    assert int(torch.argmax(logits)) == first
    fresh = engine.next_token_logits(messages=messages)     # a new assistant turn instead
    assert not torch.equal(logits, fresh)
