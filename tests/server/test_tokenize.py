"""vLLM's tokenizer endpoints over the fake engine (a token a byte): /tokenize of a prompt and of
messages through the template, /detokenize, /tokenizer_info, and their refusals."""

from engines.fake import ByteTokenizer
from tests.server.helpers import CHAT, assert_openai_error


def test_tokenize_a_prompt_and_messages(client):
    body = client.post("/tokenize", json={"model": "tiny", "prompt": "héllo",
                                          "return_token_strs": True}).json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6
    assert body["max_model_len"] == 512 and body["token_strs"][0] == "h"
    chat = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()  # default model
    assert chat["tokens"] == ByteTokenizer().apply_chat_template(CHAT["messages"])
    assert client.post("/tokenize", json={"prompt": "x"}).json()["token_strs"] is None


def test_detokenize_gives_the_text_back(client):
    ids = list("Grüße".encode())
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Grüße"}
    assert_openai_error(client.post("/detokenize", json={"tokens": [1, 900]}), 400,
                        param="tokens")


def test_tokenizer_info_names_the_end_token_and_the_context(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token_ids"] == [256] and info["model_max_length"] == 512


def test_tokenize_takes_one_input_and_known_models(client):
    assert_openai_error(client.post("/tokenize", json={"prompt": "a", **CHAT}), 400)
    assert_openai_error(client.post("/tokenize", json={}), 400)
    assert_openai_error(client.post("/tokenize", json={"model": "nope", "prompt": "a"}), 404,
                        code="model_not_found")
