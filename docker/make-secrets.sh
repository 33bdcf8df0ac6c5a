#!/bin/sh
# Write every secret docker-compose.yml reads into docker/secrets/, and the command public key the
# nodes pin into docker/command_key.pub. Files that exist are kept: delete one and run this again
# to rotate it. The directory is 0700 (no other host user reads it); the files are 0644 because
# compose bind-mounts them as they are and each service reads them as its own user.
set -eu
docker_dir=$(cd "$(dirname "$0")" && pwd)
dir="$docker_dir/secrets"
mkdir -p "$dir"
chmod 700 "$dir"

write() {
    name=$1
    shift
    if [ ! -s "$dir/$name" ]; then
        "$@" > "$dir/$name.tmp"
        chmod 644 "$dir/$name.tmp"
        mv "$dir/$name.tmp" "$dir/$name"
        echo "wrote docker/secrets/$name"
    fi
}

write postgres_password openssl rand -hex 24
write database_url sh -c 'printf "postgresql+asyncpg://kvledger:%s@postgres:5432/kvledger\n" "$(cat "$1")"' sh "$dir/postgres_password"
write master_key openssl rand -base64 32
write command_signing_key openssl genpkey -algorithm ed25519
write jwt_secret openssl rand -base64 48
write subject_key openssl rand -base64 32
write metrics_token openssl rand -base64 32
write grafana_admin_password openssl rand -base64 18
write producer_key openssl genpkey -algorithm ed25519
if [ ! -s "$docker_dir/command_key.pub" ]; then
    openssl pkey -in "$dir/command_signing_key" -pubout -out "$docker_dir/command_key.pub"
    echo "wrote docker/command_key.pub"
fi
