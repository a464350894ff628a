"""One exception type for every user-facing failure: the CLI prints its message on one line and exits 2."""


class HelmcError(Exception):
    """Bad input or an unmet requirement. The message names what was expected and what was found."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise HelmcError(message)
