"""Our error taxonomy (seed 001, Table 2, made automatic) from BFCL's error types."""

from __future__ import annotations

WRONG_SYNTAX = "wrong_syntax"                    # the output could not be decoded into calls
WRONG_FUNCTION = "wrong_function"                # a function other than the expected one
WRONG_COUNT = "wrong_count"                      # too many or too few calls
WRONG_PARAM_VALUE = "wrong_param_value"          # right parameter, wrong value
MISSING_PARAM = "missing_param"                  # a required / expected parameter is absent
UNEXPECTED_PARAM = "unexpected_param"            # a parameter that is not expected
WRONG_TYPE = "wrong_type"                        # a value of the wrong type
IRRELEVANCE_VIOLATION = "irrelevance_violation"  # a call where none is expected
RELEVANCE_MISS = "relevance_miss"                # no call where one is expected
INPUT_ERROR = "input_error"                      # the scorer's own input was unusable (not a model error)

TAXONOMY = (WRONG_SYNTAX, WRONG_FUNCTION, WRONG_COUNT, WRONG_PARAM_VALUE, MISSING_PARAM, UNEXPECTED_PARAM,
            WRONG_TYPE, IRRELEVANCE_VIOLATION, RELEVANCE_MISS)

_EXACT = {
    "simple_function_checker:wrong_func_name": WRONG_FUNCTION,
    "simple_function_checker:missing_required": MISSING_PARAM,
    "simple_function_checker:missing_optional": MISSING_PARAM,
    "simple_function_checker:unexpected_param": UNEXPECTED_PARAM,
    "irrelevance_error:decoder_success": IRRELEVANCE_VIOLATION,
    "relevance_error:decoder_failed": RELEVANCE_MISS,
    "dict_checker:unclear": WRONG_PARAM_VALUE,
    "list_dict_checker:unclear": WRONG_PARAM_VALUE,
}


def classify(error_type: str | None) -> str | None:
    """The taxonomy class of a BFCL error type (None for a valid verdict or an unknown type).

    `parallel_function_checker_no_order:cannot_find_match` has no class of its own: the checker
    classifies it from the closest failed call (see ast_checker).
    """
    if error_type is None:
        return None
    if error_type in _EXACT:
        return _EXACT[error_type]
    if error_type.startswith("ast_decoder:"):
        return WRONG_SYNTAX
    if error_type.endswith(":wrong_count"):
        return WRONG_COUNT
    if error_type.startswith("type_error:"):
        return WRONG_TYPE
    if error_type.startswith("value_error:"):
        return WRONG_PARAM_VALUE
    if error_type.startswith("toolquake:"):
        return INPUT_ERROR
    return None

#: seed 001 Table 2's four error classes, from our nine: a missing call (relevance_miss) and a call where none
#: was expected (irrelevance_violation) are a wrong number of functions; every parameter error is a wrong
#: parameter assignment
PAPER_CLASSES = ("syntax", "function", "number of functions", "parameter assignment")
PAPER_CLASS = {
    WRONG_SYNTAX: "syntax",
    WRONG_FUNCTION: "function",
    WRONG_COUNT: "number of functions",
    RELEVANCE_MISS: "number of functions",
    IRRELEVANCE_VIOLATION: "number of functions",
    WRONG_PARAM_VALUE: "parameter assignment",
    MISSING_PARAM: "parameter assignment",
    UNEXPECTED_PARAM: "parameter assignment",
    WRONG_TYPE: "parameter assignment",
}
