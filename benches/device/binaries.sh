# Sourced by run.sh, speed.sh, sweep.sh, profile.sh and serve_smollm2.sh on the device machine: prepare.sh keeps the
# stripped binaries xz-compressed in .device-bin/ (kvflow.xz, kvflow-COMMIT.xz: about 6 MB each
# against 19 MB, so a call's 64 MiB holds the working tree and two builds); unpack each once.
for packed in .device-bin/*.xz; do
    [ -e "$packed" ] || continue
    unpacked=${packed%.xz}
    [ -x "$unpacked" ] || { xz -dkf "$packed" && chmod +x "$unpacked"; } || echo "cannot unpack $packed" >&2
done
