"""What a third-party author writes to prove their family works in zoo."""

from zoo.testing.conformance import check_family


def test_mixer_conforms() -> None:
    check_family("mixer")
