//! The repository's structure rules, checked by tools/structure.py: no import cycle between the
//! modules of any crate, the policy never reaches the transfer engine or the wire messages, the
//! runtime never reaches the server, no source file over 800 lines and no function over 120 lines
//! outside tests. The script names every breach with its file and line; any breach fails the test.

use crate::common::repo;

#[test]
fn no_import_cycle_long_file_or_long_function() {
    let out = std::process::Command::new("python3")
        .arg(repo().join("tools/structure.py"))
        .output()
        .expect("python3 runs tools/structure.py");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tools/structure.py found problems:\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_structure_check_sees_a_cycle_a_long_file_and_a_long_function() {
    // The checker itself, on a tiny crate written for it: a cycle through `super`, a 801-line
    // file and a 121-line function are each named; test code is left out.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let long_fn = format!("pub fn long() {{\n{}}}\n", "    let _ = 1;\n".repeat(119));
    std::fs::write(src.join("lib.rs"), format!("pub mod a;\npub mod b;\nuse b::B;\npub struct A;\n{long_fn}")).unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::B;\npub fn f(_: B) {}\n").unwrap();
    std::fs::write(
        src.join("b.rs"),
        format!(
            "pub struct B;\npub fn g(_: super::A) {{}}\n{}#[cfg(test)]\nmod tests {{\n    use crate::a::f;\n}}\n",
            "\n".repeat(800)
        ),
    )
    .unwrap();
    let out = std::process::Command::new("python3")
        .arg(repo().join("tools/structure.py"))
        .args(["--crate", "toy", &src.to_string_lossy(), "lib.rs"])
        .output()
        .expect("python3 runs tools/structure.py");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{report}");
    assert!(
        report.contains("import cycle in toy (2 modules): toy -> toy::b -> toy")
            || report.contains("toy::b -> toy -> toy::b"),
        "{report}"
    );
    assert!(report.contains("b.rs: 806 lines"), "{report}");
    assert!(report.contains("fn long is 121 lines"), "{report}");
    assert!(!report.contains("toy::a ->") && !report.contains("-> toy::a"), "test code is not an import: {report}");
}
