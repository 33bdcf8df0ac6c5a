"""How a service's settings are read: its own variables first, then the stack-wide ones.

Every service (coordinator, node, router) is configured by ``KVLEDGER_<SERVICE>_*`` variables
and by a few stack-wide ``KVLEDGER_*`` ones that one ``kvledger up`` or compose file sets for all
of them (the metrics token, the broker's security settings, the end users' secret). Kept apart
from :mod:`identity.settings`, which token verification imports, so that verifying a token does
not pull in the broker client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from events.kafka.settings import KAFKA_SHARED_ENV
from identity.settings import JWT_SECRET_ENV, IssuerSettings


class SharedEnvSource(PydanticBaseSettingsSource):
    """Maps stack-wide ``KVLEDGER_*`` variables (variable → path of groups in the settings tree) into settings.

    Placed after the service's own environment source, so a service-specific
    variable wins over the shared one and an explicit argument over both.
    """

    def __init__(
        self, settings_cls: type[BaseSettings], mapping: Mapping[str, tuple[str, ...]]
    ) -> None:
        super().__init__(settings_cls)
        self._mapping = mapping

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        # Unused: __call__ builds the whole tree at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for variable, path in self._mapping.items():
            value = os.environ.get(variable)
            if value:
                group = values
                for name in path[:-1]:
                    group = group.setdefault(name, {})
                group[path[-1]] = value
        return values


METRICS_AND_KAFKA_ENV: Mapping[str, tuple[str, ...]] = {
    "KVLEDGER_METRICS_TOKEN": ("metrics", "token"),
    "KVLEDGER_METRICS_TOKEN_FILE": ("metrics", "token_file"),
} | {variable: ("kafka", name) for variable, name in KAFKA_SHARED_ENV.items()}
"""The stack-wide variables every service reads: the metrics token and the broker's security
settings."""


class ServiceSettings(BaseSettings):
    """Base of a service's settings: its own ``KVLEDGER_<SERVICE>_*`` variables, then the stack-wide
    ones of ``SHARED_ENV``."""

    SHARED_ENV: ClassVar[Mapping[str, tuple[str, ...]]] = METRICS_AND_KAFKA_ENV

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            SharedEnvSource(settings_cls, cls.SHARED_ENV),
            dotenv_settings,
            file_secret_settings,
        )


def refuse_shared_issuer(operator_auth: IssuerSettings, auth: IssuerSettings) -> None:
    """ValueError when a token of the end users' issuer (``auth``) could verify as an operator's."""
    if operator_auth.shares_key_with(auth, other_secret=os.environ.get(JWT_SECRET_ENV)):
        raise ValueError(
            "operator_auth must not use the end users' key: an end user could then act as an operator"
        )
