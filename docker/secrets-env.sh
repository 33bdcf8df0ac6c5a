#!/bin/sh
# Entrypoint of the kvledger images: secrets from files into the environment, then the command.
#
# For each NAME below, NAME_FILE (a path such as /run/secrets/jwt_secret, a docker secret) sets
# NAME to the file's content, trailing newlines dropped, and is removed from the environment.
# Setting both NAME and NAME_FILE, or a NAME_FILE that cannot be read, stops the container with
# one line on stderr. KVLEDGER_METRICS_TOKEN_FILE is not listed: the services read it themselves.
set -eu
for name in KVLEDGER_DATABASE_URL KVLEDGER_JWT_SECRET KVLEDGER_SUBJECT_KEY KVLEDGER_MASTER_KEY \
    KVLEDGER_COMMAND_SIGNING_KEY KVLEDGER_RECEIPT_SIGNING_KEY KVLEDGER_KAFKA_SASL_PASSWORD; do
    file=$(printenv "${name}_FILE" || true)
    [ -n "$file" ] || continue
    if [ -n "$(printenv "$name" || true)" ]; then
        echo "kvledger: set $name or ${name}_FILE, not both" >&2
        exit 2
    fi
    if [ ! -r "$file" ]; then
        echo "kvledger: cannot read ${name}_FILE ($file)" >&2
        exit 2
    fi
    value=$(cat "$file")
    export "$name=$value"
    unset "${name}_FILE"
done
exec "$@"
