# Sourced on the device machine by serve_smollm2.sh and run.sh's specbench part: joins the
# SmolLM2 GGUF's pieces (carried one a call as .device-gguf-N, gathered in /tmp/smollm2-pieces:
# see serve_smollm2.sh) into $gguf and checks their SHA-256; returns 1 when a piece is missing.
gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
pieces=/tmp/smollm2-pieces
mkdir -p "$pieces" && cp .device-gguf-*/* "$pieces"/ 2>/dev/null
if [ ! -f "$gguf" ] || [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat "$pieces"/SHA256 2>/dev/null)" ]; then
    cat "$pieces"/piece-* > "$gguf" 2>/dev/null
    if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat "$pieces"/SHA256 2>/dev/null)" ]; then
        echo "the SmolLM2 GGUF pieces do not make the file they were cut from (a piece missing?): $(ls "$pieces")"
        false
    fi
fi
