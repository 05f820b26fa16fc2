"""One venv holds kvboost and the Hugging Face LangChain/LlamaIndex stack users swap from:
a RAG chain embeds with langchain-huggingface's `HuggingFaceEmbeddings` (a tiny random
sentence-transformers model built here from a config: no hub) and answers with ChatKVBoost."""
from __future__ import annotations

from importlib import metadata

import pytest

pytest.importorskip("langchain_huggingface")
pytest.importorskip("sentence_transformers")

import torch  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_huggingface import HuggingFaceEmbeddings  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, retrieval_messages  # noqa: E402
from test_langchain_rag import CORPUS, QUESTIONS, SYSTEM  # noqa: E402


def tiny_sentence_transformer(folder, texts: list[str]) -> str:
    """A random 2-layer BERT with a WordPiece vocabulary of `texts`, saved as a sentence-transformers folder."""
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers import models as token_models
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w.strip(".,;:?").lower() for text in texts for w in text.split()} - {""})
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    tokenizer = Tokenizer(token_models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=128))
    bert.save_pretrained(folder / "hf")
    fast.save_pretrained(folder / "hf")
    word = models.Transformer(str(folder / "hf"), max_seq_length=128)
    pooling = models.Pooling(word.get_word_embedding_dimension(), "mean")
    SentenceTransformer(modules=[word, pooling, models.Normalize()], device="cpu").save(str(folder / "st"))
    return str(folder / "st")


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory):
    return tiny_sentence_transformer(tmp_path_factory.mktemp("embedder"), CORPUS + QUESTIONS)


@pytest.fixture(scope="module")
def embeddings(embedder_path):
    return HuggingFaceEmbeddings(model_name=embedder_path, model_kwargs={"device": "cpu"})


def test_the_hf_stack_installs_beside_kvboost():
    assert metadata.version("langchain-huggingface").startswith("1.2.")
    assert metadata.version("llama-index-llms-huggingface").startswith("0.8.")
    assert metadata.version("llama-index-embeddings-huggingface").startswith("0.8.")
    from llama_index.llms.huggingface import HuggingFaceLLM  # noqa: F401 - importable beside us


def test_llama_index_embedding_agrees_with_langchain(embedder_path, embeddings):
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    ours = HuggingFaceEmbedding(model_name=embedder_path, device="cpu").get_query_embedding(QUESTIONS[0])
    theirs = embeddings.embed_query(QUESTIONS[0])
    assert len(ours) == len(theirs) == 32
    assert sum(a * b for a, b in zip(ours, theirs)) > 0.9999


def test_rag_chain_with_huggingface_embeddings_answers_with_chatkvboost(smol, embeddings):
    store = InMemoryVectorStore(embeddings)
    store.add_documents([Document(page_content=text, id=str(i)) for i, text in enumerate(CORPUS)])
    retriever = store.as_retriever(search_kwargs={"k": 3})
    model, tokenizer = smol
    replies = {}
    for name, cache_bytes in (("kvboost", 256 * 2**20), ("cold", 0)):
        engine = Engine(model, tokenizer, cache_bytes=cache_bytes)
        chain = retrieval_messages(retriever, system=SYSTEM) | ChatKVBoost(engine=engine, max_tokens=8)
        replies[name] = [chain.invoke(question) for question in QUESTIONS[:2]]
    assert all(reply.content.strip() for reply in replies["kvboost"])
    assert [r.content for r in replies["kvboost"]] == [r.content for r in replies["cold"]]
    assert replies["kvboost"][1].response_metadata["reused_exact"] > 0
