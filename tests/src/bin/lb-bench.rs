fn main() {
    eprintln!("lb-bench: being written");
}
