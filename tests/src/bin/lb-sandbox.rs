fn main() {
    eprintln!("lb-sandbox: being written");
}
