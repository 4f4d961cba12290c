"""Every unknown path under an edge answers 404 in that edge's error shape
(a client parses only its own vendor's errors); paths under no edge answer
in OpenAI's, the shape most clients here parse."""
import pytest

OPENAI = lambda got: set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
ANTHROPIC = lambda got: got["type"] == "error" and set(got["error"]) == {"type", "message"} and got["error"]["type"] == "not_found_error"
LLAMACPP = lambda got: set(got) == {"error"} and got["error"]["code"] == 404 and got["error"]["type"] == "not_found_error"

PATHS = [
    ("/v1/messages/nope", ANTHROPIC),
    ("/v1/messages/count_tokens/nope", ANTHROPIC),
    ("/v1/nothing-here", OPENAI),
    ("/v1/chat/completions/nope", OPENAI),
    ("/v1/responses/resp_x/nope", OPENAI),
    ("/infill/nope", LLAMACPP),
    ("/completion/nope", LLAMACPP),
    ("/v1/health/nope", LLAMACPP),
    ("/nothing-here", OPENAI),
]


@pytest.mark.parametrize("path,shape", PATHS, ids=[p for p, _ in PATHS])
def test_an_unknown_path_answers_in_its_edges_shape(smollm2, path, shape):
    status, got = smollm2.post(path, {})
    assert status == 404 and shape(got), (path, got)
