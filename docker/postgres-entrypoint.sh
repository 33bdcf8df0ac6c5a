#!/bin/sh
# Initialises $PGDATA on first start (superuser POSTGRES_USER with POSTGRES_PASSWORD, database
# POSTGRES_DB, password auth for every TCP client), then runs the server in the foreground.
# Nothing listens on TCP until the database exists, so a client that connects finds it.
set -eu
: "${POSTGRES_USER:?set POSTGRES_USER}" "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  "$bin/initdb" --pgdata="$PGDATA" --username="$POSTGRES_USER" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\"" | "$bin/postgres" --single -D "$PGDATA" postgres >/dev/null
  fi
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp "$@"
